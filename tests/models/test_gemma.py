"""Gemma 2 and Gemma 3 (text): greedy token ids and text equal HF transformers' eager
`generate(do_sample=False)` at every layout (PP 1, 2, 3 uneven, TP 2, TP 2 x PP 2; `mp` and
`ray`), also with chunked prefill and with prefix caching; logprobs (prompt and sampled) equal
HF's log-softmax of the soft-capped logits; the tiny checkpoints (tests/utils/tiny_gemma.py) are
such that the window and the attention soft-cap change HF's greedy choices, so the equality
tests would catch a model that ignored them; the Gemma pieces against HF's modules.
"""

from __future__ import annotations

import pytest
import torch

from tests.utils import tiny_gemma, tiny_models
from vllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "max_num_seqs": 8}
PREFIX = {"enable_prefix_caching": True}


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory) -> dict[str, str]:
    return tiny_gemma.gemma_dirs(str(tmp_path_factory.mktemp("gemma")))


@pytest.fixture(scope="module")
def hf_models(gemma_dirs):
    return {kind: tiny_gemma.load_hf(path) for kind, path in gemma_dirs.items()}


@pytest.fixture(scope="module")
def reference(gemma_dirs, hf_models):
    """kind -> HF greedy ids of tiny_models.PROMPTS (32 new tokens), computed once."""
    from transformers import AutoTokenizer

    cache: dict[str, list[list[int]]] = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            tokenizer = AutoTokenizer.from_pretrained(gemma_dirs[kind])
            cache[kind] = tiny_models.hf_greedy_with(
                hf_models[kind], tokenizer, tiny_models.PROMPTS, 32
            )
        return cache[kind]

    return get


# The prompts longer than a KV block (16 tokens): a second run finds their blocks cached.
LONG = [2, 3, 7]


def check_equal(llm: LLM, expected: list[list[int]], which: list[int] | None = None) -> None:
    """Greedy ids and text of tiny_models.PROMPTS (or those at `which`, 12 tokens each) equal
    `expected` (HF's 32 tokens, or their first 12)."""
    prompts, params = tiny_models.PROMPTS, GREEDY
    if which is not None:
        prompts = [prompts[i] for i in which]
        expected = [expected[i][:12] for i in which]
        params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref, f"prompt {out.prompt!r}"
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


def check_prefix_hits(llm: LLM, expected: list[list[int]]) -> None:
    """After a first run, the long prompts again: their prefills start after cached blocks
    (longer than the window), and still equal HF."""
    check_equal(llm, expected, LONG)
    assert llm.llm_engine.scheduler.block_manager.get_prefix_cache_hit_rate() > 0


def _greedy_positions(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits[0].argmax(-1)


@pytest.mark.parametrize(
    "kind,overrides",
    [
        ("gemma2", {"sliding_window": 10**6}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma3", {"sliding_window": 10**6}),
    ],
)
def test_window_and_soft_cap_change_hf_greedy(kind, overrides, gemma_dirs, hf_models):
    """Without its window (or its attention soft-cap) the HF model picks other greedy tokens
    at positions of the long prompts: so the equality tests cannot pass with either ignored."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma_dirs[kind])
    other = tiny_gemma.load_hf(gemma_dirs[kind], **overrides)
    changed = 0
    for index in LONG:
        ids = torch.tensor([tokenizer.encode(tiny_models.PROMPTS[index])])
        a, b = _greedy_positions(hf_models[kind], ids), _greedy_positions(other, ids)
        changed += int((a != b).sum())
    assert changed >= 3


@pytest.fixture(scope="module")
def uni_llm(request, gemma_dirs):
    """One in-process engine per kind, shared by the PP = 1 tests."""
    engines: dict[str, LLM] = {}

    def get(kind: str) -> LLM:
        if kind not in engines:
            engines[kind] = LLM(gemma_dirs[kind], kv_cache_space=0.05, swap_space=0.01)
        return engines[kind]

    yield get
    for llm in engines.values():
        llm.shutdown()


@pytest.mark.parametrize("kind", tiny_gemma.KINDS)
def test_pp1_matches_hf(kind, uni_llm, reference):
    check_equal(uni_llm(kind), reference(kind))


@pytest.mark.parametrize("kind", tiny_gemma.KINDS)
def test_logprobs_are_hf_soft_capped_log_softmax(kind, uni_llm, gemma_dirs, hf_models):
    """Prompt and sampled logprobs equal HF's log-softmax of the final-soft-capped logits (and
    differ from the uncapped ones by far more than the tolerance)."""
    llm = uni_llm(kind)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    prompts = [tiny_models.PROMPTS[2], tiny_models.PROMPTS[7]]
    cap = hf_models[kind].config.final_logit_softcapping
    assert cap is not None
    for out in llm.generate(prompts, params, use_tqdm=False):
        gen = out.outputs[0]
        ids = torch.tensor([out.prompt_token_ids + gen.token_ids])
        with torch.inference_mode():
            logits = hf_models[kind](ids).logits[0].float()  # capped by HF
            hidden = hf_models[kind].model(ids).last_hidden_state[0]
            raw = hf_models[kind].lm_head(hidden).float()
        expected = torch.log_softmax(logits, -1)
        uncapped = torch.log_softmax(raw, -1)
        n_prompt = len(out.prompt_token_ids)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        rows = [(out.prompt_logprobs[i], i - 1, ids[0, i]) for i in range(1, n_prompt)]
        rows += [(gen.logprobs[j], n_prompt + j - 1, ids[0, n_prompt + j]) for j in range(4)]
        max_uncapped_gap = 0.0
        for entries, pos, token in rows:
            for tok, lp in entries.items():
                assert lp.logprob == pytest.approx(float(expected[pos, tok]), abs=2e-4)
            gap = abs(float(uncapped[pos, token]) - float(expected[pos, token]))
            max_uncapped_gap = max(max_uncapped_gap, gap)
        assert max_uncapped_gap > 1e-2


@pytest.mark.parametrize("kind", tiny_gemma.KINDS)
@pytest.mark.parametrize("features", [CHUNKED, PREFIX], ids=["chunked", "prefix"])
def test_pp1_chunked_prefill_and_prefix_caching(kind, features, gemma_dirs, reference):
    """Chunks of 16 tokens (windows of 8 and 12: chunks start inside and past a window); with
    prefix caching, the second run prefills after cached blocks longer than the window."""
    llm = LLM(gemma_dirs[kind], kv_cache_space=0.05, swap_space=0.01, **features)
    try:
        check_equal(llm, reference(kind))
        if features is PREFIX:
            check_prefix_hits(llm, reference(kind))
    finally:
        llm.shutdown()


# (backend, tp, pp, features): every layout on both backends, each with chunked prefill or
# prefix caching on somewhere.
LAYOUTS = [
    ("mp", 1, 2, PREFIX),
    ("mp", 1, 3, CHUNKED),
    ("mp", 2, 1, {}),
    ("mp", 2, 2, {**CHUNKED, **PREFIX}),
    ("ray", 1, 2, CHUNKED),
    ("ray", 1, 3, PREFIX),
    ("ray", 2, 1, PREFIX),
    ("ray", 2, 2, {}),
]


def _layout_id(layout: tuple) -> str:
    backend, tp, pp, features = layout
    names = ["chunked"] * ("enable_chunked_prefill" in features) + ["prefix"] * (
        "enable_prefix_caching" in features
    )
    return "-".join([backend, f"tp{tp}", f"pp{pp}", *names])


@pytest.mark.parametrize("kind", tiny_gemma.KINDS)
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(layout, id=_layout_id(layout), marks=[pytest.mark.ray] * (layout[0] == "ray"))
        for layout in LAYOUTS
    ],
)
def test_layouts_match_hf(kind, layout, request, gemma_dirs, reference):
    backend, tp, pp, features = layout
    if backend == "ray":
        request.getfixturevalue("ray_session")
    llm = LLM(
        gemma_dirs[kind],
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        kv_cache_space=0.05,
        swap_space=0.01,
        **features,
    )
    try:
        if pp > 1:
            # Every stage holds local and global layers (PP = 3 splits 7 layers unevenly).
            ranges = [i.layers for i in llm.llm_engine.get_stage_infos() if i.layers]
            types = llm.llm_engine.model_config.hf_config.layer_types
            for start, end in ranges:
                assert {"sliding_attention", "full_attention"} <= set(types[start:end])
            if pp == 3:
                assert len({end - start for start, end in ranges}) > 1
        check_equal(llm, reference(kind))
        if "enable_prefix_caching" in features:
            check_prefix_hits(llm, reference(kind))
    finally:
        llm.shutdown()


def test_gemma_rms_norm_matches_hf():
    """GemmaRMSNorm ((1 + w), float32 math) equals HF's, alone and with the fused residual,
    in float32 (kernel when built) and bfloat16 (torch)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        ours, theirs = GemmaRMSNorm(48, 1e-6).to(dtype), Gemma2RMSNorm(48, 1e-6).to(dtype)
        w = 0.1 * torch.randn(48, generator=gen)
        with torch.no_grad():
            ours.weight.copy_(w)
            theirs.weight.copy_(w)
        x = torch.randn(5, 48, generator=gen).to(dtype)
        res = torch.randn(5, 48, generator=gen).to(dtype)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
        torch.testing.assert_close(ours(x.clone()), theirs(x), **tol)
        normed, summed = ours(x.clone(), res.clone())
        torch.testing.assert_close(summed, res + x, rtol=0, atol=0)
        torch.testing.assert_close(normed, theirs(res + x), **tol)


def test_unsupported_activation_and_bidirectional_are_refused(gemma_dirs):
    from transformers import AutoConfig

    from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM
    from vllm.model_executor.models.utils import StageLayout

    layout = StageLayout(0, 1, True, True)
    config = AutoConfig.from_pretrained(gemma_dirs["gemma2"])
    config.hidden_activation = "relu"
    with pytest.raises(ValueError, match="hidden_activation"):
        Gemma2ForCausalLM(config, layout)
    config = AutoConfig.from_pretrained(gemma_dirs["gemma2"])
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma2ForCausalLM(config, layout)
