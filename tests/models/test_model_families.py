"""The LLaMA-style families users serve (Llama 3.1, Mistral, Qwen2.5, Qwen3, Phi-3) on tiny
random-weight checkpoints saved by HF transformers: greedy ids and text equal HF's
`generate(do_sample=False)` at PP 1, 2, 3 (uneven), TP 2 and TP 2 x PP 2, on `mp` and `ray`,
with chunked prefill, with prefix caching, through each family's chat template; every rope
variant's cos/sin equals transformers' `ROPE_INIT_FUNCTIONS`; KV sizing and the `auto` split
follow each model's own shapes.

The models' configs are in family_models.py (sliding windows off: windowed attention is not
wired yet). Engines are shared where a test only adds prompts: one PP=1 engine per family
(prefix caching on) serves the plain, shared-prefix and chat checks.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.utils import family_models, tiny_models
from vllm import LLM, SamplingParams

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
KV_GIB = 0.05

# Prompts sharing a prefix of several full blocks (16 tokens each): prefix-cache hits.
PREFIX = (
    "The following is a conversation between a patient teacher and a curious student about "
    "the history of mathematics, from counting sticks to calculus. "
)
PREFIX_PROMPTS = [PREFIX + s for s in ("Who was Euclid?", "What is zero?", "Why prove things?")]
CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name three colours."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "And three more?"},
    ],
]


def prompts_of(kind: str) -> list[str]:
    """Phi-3 also gets prompts past its original context (longrope's long factors)."""
    extra = family_models.LONG_PROMPTS if kind == "phi3" else []
    return tiny_models.PROMPTS + extra


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    return family_models.family_dirs(str(tmp_path_factory.mktemp("families")))


@pytest.fixture(scope="module")
def hf_ids(dirs, request):
    """(kind, prompt token ids) -> HF greedy new ids, each computed once; models loaded once
    per kind."""
    models: dict[str, Any] = {}
    cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def get(kind: str, prompts: list[list[int]]) -> list[list[int]]:
        if kind not in models:
            path = dirs.get(kind) or request.getfixturevalue("window_dirs")[kind]
            models[kind] = tiny_models.load_hf(path)
        model = models[kind]
        out = []
        for ids in prompts:
            key = (kind, tuple(ids))
            if key not in cache:
                # One thread: on a loaded 2-core machine HF's tiny matmuls ran ~10x slower
                # on two (2.9 s against 0.27 s a prompt, measured).
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    with torch.inference_mode():
                        t = torch.tensor([ids])
                        gen = model.generate(
                            t,
                            attention_mask=torch.ones_like(t),
                            max_new_tokens=MAX_TOKENS,
                            do_sample=False,
                            pad_token_id=model.config.pad_token_id,
                        )
                finally:
                    torch.set_num_threads(threads)
                cache[key] = gen[0, t.shape[1] :].tolist()
            out.append(cache[key])
        return out

    return get


def check_equal(llm: LLM, kind: str, hf_ids, prompts: list[str]) -> None:
    tokenizer = llm.get_tokenizer()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    refs = hf_ids(kind, [tokenizer.encode(p) for p in prompts])
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref, f"{kind}: prompt {out.prompt[:60]!r}"
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


def make_llm(path: str, tp: int = 1, pp: int = 1, backend: Any = None, **kwargs: Any) -> LLM:
    return LLM(
        path,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        kv_cache_space=KV_GIB,
        swap_space=0.01,
        **kwargs,
    )


# ---------------------------------------------------------------- every family at PP = 1


@pytest.mark.parametrize("kind", family_models.FAMILIES)
def test_family_pp1_prefix_caching_and_chat(kind, dirs, hf_ids):
    """One engine (prefix caching on): the prompts, prompts sharing a prefix (run twice: the
    second time from cached blocks), and chat conversations through the family's template."""
    llm = make_llm(dirs[kind], enable_prefix_caching=True)
    try:
        check_equal(llm, kind, hf_ids, prompts_of(kind))
        check_equal(llm, kind, hf_ids, PREFIX_PROMPTS)
        check_equal(llm, kind, hf_ids, PREFIX_PROMPTS[::-1])
        assert llm.llm_engine.scheduler.block_manager.get_prefix_cache_hit_rate() > 0

        tokenizer = llm.get_tokenizer()
        texts = [
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in CHAT
        ]
        assert texts[0] == family_models.expected_chat_text(kind, tokenizer, CHAT[0])
        refs = hf_ids(kind, [tokenizer.encode(t, add_special_tokens=False) for t in texts])
        outs = llm.chat(CHAT, GREEDY, use_tqdm=False)
        assert [o.prompt for o in outs] == texts
        for out, ref in zip(outs, refs):
            assert out.outputs[0].token_ids == ref
            assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", family_models.FAMILIES)
def test_family_chunked_prefill(kind, dirs, hf_ids):
    """Prompts cut into 16-token chunks next to other requests' decodes."""
    llm = make_llm(
        dirs[kind], enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8
    )
    try:
        check_equal(llm, kind, hf_ids, prompts_of(kind))
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- parallel layouts


LAYOUTS = [
    # (kind, tp, pp, backend): every layout on both backends and every family at every layout.
    ("qwen3", 1, 2, "mp"),
    pytest.param("phi3", 1, 2, "ray", marks=pytest.mark.ray),
    ("qwen2", 1, 3, "mp"),  # 4 layers on 3 stages: 2/1/1
    pytest.param("mistral", 1, 3, "ray", marks=pytest.mark.ray),
    ("phi3", 2, 1, "mp"),  # fused qkv / gate_up split per rank; its one KV head replicated
    ("mistral", 2, 1, "mp"),  # head_dim 32 > hidden / heads
    pytest.param("qwen2", 2, 1, "ray", marks=pytest.mark.ray),  # q/k/v biases sharded
    ("llama3", 2, 2, "mp"),
    pytest.param("qwen3", 2, 2, "ray", marks=pytest.mark.ray),  # q/k norms on every rank
    # The rest of the grid: every family at every layout, each on one of the two backends.
    pytest.param("llama3", 1, 2, "ray", marks=pytest.mark.ray),
    ("mistral", 1, 2, "mp"),
    pytest.param("qwen2", 1, 2, "ray", marks=pytest.mark.ray),
    ("llama3", 1, 3, "mp"),
    pytest.param("qwen3", 1, 3, "ray", marks=pytest.mark.ray),
    ("phi3", 1, 3, "mp"),
    pytest.param("llama3", 2, 1, "ray", marks=pytest.mark.ray),
    ("qwen3", 2, 1, "mp"),
    pytest.param("mistral", 2, 2, "ray", marks=pytest.mark.ray),
    ("qwen2", 2, 2, "mp"),
    pytest.param("phi3", 2, 2, "ray", marks=pytest.mark.ray),
]


@pytest.mark.parametrize("kind,tp,pp,backend", LAYOUTS)
def test_family_layouts_match_hf(kind, tp, pp, backend, dirs, hf_ids, request):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    llm = make_llm(dirs[kind], tp, pp, backend)
    try:
        infos = llm.llm_engine.get_stage_infos()
        sizes = sorted({i.layers for i in infos if i.layers})
        assert [e - s for s, e in sizes] == {1: [4], 2: [2, 2], 3: [2, 1, 1]}[pp]
        check_equal(llm, kind, hf_ids, prompts_of(kind))
    finally:
        llm.shutdown()


def test_chunked_prefill_across_stages(dirs, hf_ids):
    """Phi-3's long prompts in 16-token chunks over two mp stages: every chunk of a prompt
    longer than the original context gets the long factors on every stage."""
    llm = make_llm(
        dirs["phi3"], 1, 2, "mp", enable_chunked_prefill=True, max_num_batched_tokens=16,
        max_num_seqs=8,
    )  # fmt: skip
    try:
        check_equal(llm, "phi3", hf_ids, family_models.LONG_PROMPTS + tiny_models.PROMPTS[:3])
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- KV sizing and splits


def test_kv_blocks_count_each_layers_own_shape(dirs):
    """Qwen3's head_dim (32) is not hidden / heads (16): the blocks are sized from it."""
    llm = make_llm(dirs["qwen3"])
    try:
        shapes = llm.llm_engine.executor.worker._layer_kv_shapes()
        assert shapes == [(2, 32)] * family_models.NUM_LAYERS
        block_bytes = 2 * 16 * 2 * 32 * family_models.NUM_LAYERS * 4  # K+V, 16 tokens, fp32
        assert llm.llm_engine.cache_config.num_gpu_blocks == int(KV_GIB * (1 << 30)) // block_bytes
        cache = llm.llm_engine.executor.worker.cache_engine.gpu_cache
        assert all(k.shape[2:] == (2, 32) for k, _ in cache)
    finally:
        llm.shutdown()


def test_auto_split_weighs_a_large_vocabulary_head():
    """A Qwen2.5-0.5B-shaped config (151,936 x 896 lm_head, 24 layers): `auto` gives the last
    stage fewer layers, by what its head costs in layers' matmul work."""
    from transformers import Qwen2Config

    from vllm.config import ModelConfig, ParallelConfig

    cfg = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"],
    )  # fmt: skip
    mc = ModelConfig("qwen2.5-0.5b-shaped", hf_config=cfg)
    head_dim = 64
    layer = (14 + 4) * head_dim * 896 + 896 * 14 * head_dim + 2 * 4864 * 896 + 896 * 4864
    assert math.isclose(mc.get_lm_head_cost_in_layers(), 151936 * 896 / layer)
    sizes = mc.get_pp_layer_sizes(
        ParallelConfig(pipeline_parallel_size=2, pp_layer_partition="auto")
    )
    assert sum(sizes) == 24 and sizes[1] < sizes[0]
    assert sizes[1] + mc.get_lm_head_cost_in_layers() <= sizes[0] + 1


# ---------------------------------------------------------------- registry and configs


def test_registry_names_and_unsupported_architecture():
    from vllm.model_registry import check_architecture, get_supported_archs

    archs = get_supported_archs()
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert name in archs
    assert {"Qwen3ForCausalLM", "Phi3ForCausalLM", "OPTForCausalLM"} <= set(archs)

    class Config:
        architectures = ["FalconForCausalLM"]

    with pytest.raises(ValueError) as err:
        check_architecture(Config())
    assert "Model architectures ['FalconForCausalLM'] are not supported for now." in str(err.value)
    assert "'Phi3ForCausalLM'" in str(err.value)


def test_unknown_rope_type_fails_at_once_naming_it(dirs, tmp_path):
    import json
    import shutil

    path = tmp_path / "bad-rope"
    shutil.copytree(dirs["mistral"], path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "wobbly", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config))
    from vllm.config import ModelConfig

    with pytest.raises(ValueError, match="rope_scaling type 'wobbly' is not supported"):
        ModelConfig(str(path))
    from vllm.model_executor.layers.rotary import RotaryEmbedding

    with pytest.raises(ValueError, match="'wobbly'"):
        RotaryEmbedding(16, 64, 10000.0, {"type": "wobbly"})


def test_context_length_follows_rope_scaling():
    """vLLM's rule: linear/dynamic stretch max_position_embeddings by the factor, yarn the
    original context; llama3 and longrope configs already name their extended length."""
    from vllm.transformers_utils.rope_config import scaled_max_positions

    assert scaled_max_positions({"rope_type": "linear", "factor": 2.0}, 512) == 1024
    assert scaled_max_positions({"type": "dynamic", "factor": 4.0}, 512) == 2048
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert scaled_max_positions(yarn, 32768) == 131072
    assert scaled_max_positions({"rope_type": "llama3", "factor": 8.0}, 131072) == 131072
    assert scaled_max_positions({}, 2048) == 2048


# ---------------------------------------------------------------- rope against HF


def _hf_config(rope: dict[str, Any], max_pos: int = 64, **extra: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=max_pos,
        rope_parameters=dict(rope), **extra,
    )  # fmt: skip


ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
             "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                    "original_max_position_embeddings": 16, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 10000.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0,
                 "short_factor": family_models.LONGROPE_SHORT,
                 "long_factor": family_models.LONGROPE_LONG,
                 "original_max_position_embeddings": 16},
}  # fmt: skip


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_frequencies_equal_transformers(name):
    """inv_freq and attention factor at initialisation and for a grown sequence, and the cos
    cache rows, bit for bit against transformers' ROPE_INIT_FUNCTIONS."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from vllm.model_executor.layers.rotary import compute_inv_freq, get_rope
    from vllm.transformers_utils.rope_config import get_rope_parameters

    config = _hf_config(ROPES[name])
    params = get_rope_parameters(config)
    hf_fn = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    for seq_len in (None, 40, 65, 200):
        hf_seq = None if seq_len is None else torch.tensor(seq_len)
        if params["rope_type"] == "longrope" and seq_len is not None:
            hf_seq = seq_len  # HF passes longrope a python int
        want, want_scale = hf_fn(config, None, seq_len=hf_seq)
        got, got_scale = compute_inv_freq(params, 16, 64, seq_len)
        assert torch.equal(got, want), (name, seq_len)
        assert got_scale == pytest.approx(want_scale, rel=1e-12)
    rope = get_rope(config, 16)
    inv, scale = hf_fn(config, None)
    positions = torch.arange(64).float()
    freqs = positions[:, None] * inv[None, :]
    want_cos = torch.cat((freqs, freqs), dim=-1).cos() * scale
    assert torch.equal(rope.cos_cache[:64], want_cos)


def _hf_rotate(config: Any, rope_cls: Any, q: torch.Tensor, k: torch.Tensor, n: int) -> Any:
    """HF's rotary module over one forward call of positions [0, n), applied to q/k
    [n, H, D] with transformers' apply_rotary_pos_emb (partial rotary aware)."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    module = rope_cls(config)
    cos, sin = module(q, torch.arange(n)[None])
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return qh[0].transpose(0, 1), kh[0].transpose(0, 1)


@pytest.mark.parametrize(
    "name,n,partial",
    [
        ("longrope", 12, 1.0),  # within the original context: short factors
        ("longrope", 40, 1.0),  # a 40-token prefill: long factors for every token
        ("dynamic", 50, 1.0),  # within max_position_embeddings (64): the base unchanged
        ("dynamic", 90, 1.0),  # past it: the base grown for s = 90
        ("llama3", 60, 0.5),  # partial rotary: the first 8 of 16 dims turn
        ("yarn", 30, 1.0),
    ],
)
def test_rope_forward_equals_transformers_per_call(name, n, partial):
    """A prefill of n tokens (one HF forward call, s = n) rotated like HF's rotary module,
    through the torch path and the C++ kernel (when built), given token_seq_lens' s."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from vllm.model_executor.input_metadata import InputMetadata
    from vllm.model_executor.layers.rotary import get_rope, token_seq_lens

    extra = {"partial_rotary_factor": partial} if partial != 1.0 else {}
    rope_dict = dict(ROPES[name], **extra)
    config = _hf_config(rope_dict, max_pos=64)
    rope = get_rope(config, 16, max_position=64)
    assert rope.rotary_dim == int(16 * partial)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, 4, 16, generator=gen)
    k = torch.randn(n, 2, 16, generator=gen)
    want_q, want_k = _hf_rotate(config, LlamaRotaryEmbedding, q, k, n)
    empty = torch.empty(0, dtype=torch.long)
    md = InputMetadata(
        num_prefills=1, num_prefill_tokens=n, num_decode_tokens=0, slot_mapping=empty,
        prefill_seq_lens=torch.tensor([n]), decode_context_lens=empty,
        decode_block_tables=empty.view(0, 0),
    )  # fmt: skip
    positions = torch.arange(n)
    seq_lens = token_seq_lens(positions, md)
    assert seq_lens.tolist() == [n] * n
    got_q, got_k = rope(positions, q.reshape(n, -1).clone(), k.reshape(n, -1).clone(), seq_lens)
    assert torch.equal(got_q.view(n, 4, 16), want_q)
    assert torch.equal(got_k.view(n, 2, 16), want_k)


def test_token_seq_lens_mixes_chunks_and_decodes():
    """A later chunk of a 40-token prompt and two decodes: the chunk's tokens see the whole
    prompt (40), decodes their own length."""
    from vllm.model_executor.input_metadata import InputMetadata
    from vllm.model_executor.layers.rotary import token_seq_lens

    md = InputMetadata(
        num_prefills=1, num_prefill_tokens=4, num_decode_tokens=2,
        slot_mapping=torch.zeros(6, dtype=torch.long), prefill_seq_lens=torch.tensor([4]),
        decode_context_lens=torch.tensor([8, 70]),
        decode_block_tables=torch.zeros(2, 5, dtype=torch.long),
        prefill_context_lens=torch.tensor([16]), prefill_total_lens=torch.tensor([40]),
    )  # fmt: skip
    positions = torch.tensor([16, 17, 18, 19, 7, 69])
    assert token_seq_lens(positions, md).tolist() == [40, 40, 40, 40, 8, 70]


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize(
    "kind,tp,arch",
    [
        ("mistral", 1, "LlamaForCausalLM"),  # llama.cpp writes Mistral as llama (Q/K permuted)
        ("qwen2", 1, "Qwen2ForCausalLM"),  # biases; yarn from the rope.scaling keys
        ("qwen3", 1, "Qwen3ForCausalLM"),  # q/k norms; head_dim from attention.key_length
        ("phi3", 2, "Phi3ForCausalLM"),  # fused tensors cut per TP rank; longrope factor tensors
    ],
)
def test_gguf_families_match_hf(kind, tp, arch, dirs, hf_ids, tmp_path):
    """Each family written as an F32 GGUF file the way llama.cpp names it loads to the same
    model: greedy output equal to HF's on the original checkpoint."""
    from vllm.transformers_utils.gguf_config import load_gguf_config

    path = family_models.write_gguf(dirs[kind], str(tmp_path / f"{kind}.gguf"), kind)
    config = load_gguf_config(path)
    assert config.architectures == [arch]
    llm = make_llm(path, tp, 1, "mp" if tp > 1 else None, tokenizer=dirs[kind])
    try:
        check_equal(llm, kind, hf_ids, prompts_of(kind))
    finally:
        llm.shutdown()


def test_sliding_window_is_read_per_layer():
    """Recorded for the attention backend: Mistral and Phi-3 window every layer, Qwen2/3 only
    the layers `layer_types` marks (from max_window_layers on), none when switched off."""
    from transformers import MistralConfig, Qwen2Config

    from vllm.model_executor.models.llama import sliding_window_of

    mistral = MistralConfig(num_hidden_layers=3, sliding_window=64)
    assert [sliding_window_of(mistral, i) for i in range(3)] == [64, 64, 64]
    qwen = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=32, max_window_layers=2
    )
    assert [sliding_window_of(qwen, i) for i in range(4)] == [None, None, 32, 32]
    off = Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=32)
    assert [sliding_window_of(off, i) for i in range(2)] == [None, None]


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_gguf_tokenizer_and_chat_template_from_the_file(kind, dirs, hf_ids, tmp_path, monkeypatch):
    """A GGUF file holding its tokenizer (SmolLM2's BPE) and the family's chat template: the
    engine builds both from the file; ids, text and LLM.chat equal HF's."""
    from transformers import AutoTokenizer

    from vllm.transformers_utils.gguf_config import resolve_model

    monkeypatch.setenv("VLLM_PP_CACHE_DIR", str(tmp_path / "cache"))
    fields = family_models.gguf_tokenizer_fields(resolve_model("smollm2"))
    path = family_models.write_gguf(dirs[kind], str(tmp_path / f"{kind}.gguf"), kind, fields)
    llm = make_llm(path)
    try:
        tokenizer = llm.get_tokenizer()
        reference = AutoTokenizer.from_pretrained(dirs[kind])
        for prompt in tiny_models.PROMPTS:
            assert tokenizer.encode(prompt) == reference.encode(prompt)
        assert tokenizer.chat_template == family_models.CHAT_TEMPLATES[kind]
        check_equal(llm, kind, hf_ids, tiny_models.PROMPTS[:4])
        text = reference.apply_chat_template(CHAT[0], tokenize=False, add_generation_prompt=True)
        (ref,) = hf_ids(kind, [reference.encode(text, add_special_tokens=False)])
        (out,) = llm.chat(CHAT[0], GREEDY, use_tqdm=False)
        assert out.prompt == text and out.outputs[0].token_ids == ref
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- sliding windows


@pytest.fixture(scope="module")
def window_dirs(dirs) -> dict[str, str]:
    import os

    root = os.path.dirname(dirs["mistral"])
    tok_dir = os.path.join(root, "tokenizer")
    return {
        kind: family_models.build_family(kind, os.path.join(root, kind), tok_dir)
        for kind in family_models.WINDOWED
    }


@pytest.mark.parametrize(
    "kind,pp,backend,chunked",
    [
        ("mistral-window", 1, None, False),
        ("qwen2-window", 1, None, True),
        ("qwen2-window", 2, "mp", False),  # windowed layers 2, 3 on the second stage
    ],
)
def test_sliding_window_families(kind, pp, backend, chunked, window_dirs, hf_ids, request):
    """16-token windows, prompts of up to 65 tokens: equal to HF's windowed attention, and
    the window changes HF's greedy output (so the check can fail)."""
    from transformers import AutoModelForCausalLM

    chunks = dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8)
    llm = make_llm(window_dirs[kind], 1, pp, backend, **(chunks if chunked else {}))
    try:
        assert len(llm.llm_engine.get_stage_infos()) == pp
        check_equal(llm, kind, hf_ids, tiny_models.PROMPTS)
        if pp == 1:
            tokenizer = llm.get_tokenizer()
            ids = [tokenizer.encode(p) for p in tiny_models.PROMPTS]
            windowed = hf_ids(kind, ids)
            no_window: dict[str, Any] = {"sliding_window": None}
            if kind.startswith("qwen2"):
                no_window["layer_types"] = ["full_attention"] * family_models.NUM_LAYERS
            full = AutoModelForCausalLM.from_pretrained(
                window_dirs[kind], dtype=torch.float32, **no_window
            ).eval()
            unwindowed = tiny_models.hf_greedy_with(
                full, tokenizer, tiny_models.PROMPTS, MAX_TOKENS
            )
            assert windowed != unwindowed
    finally:
        llm.shutdown()
