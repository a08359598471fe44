"""Multi-LoRA (vLLM's API): PEFT adapters made here on tiny random-weight models; greedy ids and
text with each adapter equal HF transformers + PEFT (`PeftModel`) at PP 1, 2 (mp), 3 (mp) and
TP 2 (mp, and Ray at TP 2 x PP 2), and equal the merged model (`merge_and_unload`); a batch
mixing three adapters and the base model gives each request what it gets alone; `max_loras=1`
with three adapters swaps slots and finishes everything (and `max_cpu_loras=1` reloads evicted
adapters from disk); OPT, Qwen2 and Phi-3 (whose checkpoints fuse q/k/v and gate/up, so its
adapters do too); prefix caching never shares blocks across adapters; n-gram speculation
verifies with each request's adapter; vLLM's errors for bad adapters and bad requests.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.utils import family_models, lora_adapters, tiny_models
from vllm import LLM, SamplingParams
from vllm.config import LoRAConfig
from vllm.core.block_manager import BlockSpaceManager
from vllm.core.lora_admission import LoRAAdmission
from vllm.lora.request import LoRARequest
from vllm.sequence import Sequence, SequenceGroup

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PROMPTS = tiny_models.PROMPTS[:4]
KIND = "llama-gqa-untied"
# Adapter name -> its id in every engine of this module.
IDS = {name: i + 1 for i, name in enumerate(lora_adapters.ADAPTERS)}


def engine(path: str, **kwargs: Any) -> LLM:
    kwargs.setdefault("max_loras", 2)
    kwargs.setdefault("max_lora_rank", 8)
    return LLM(path, enable_lora=True, kv_cache_space=0.05, swap_space=0.01, **kwargs)


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("lora_adapters"))
    return lora_adapters.make_adapters(tiny_model_dirs[KIND], root)


@pytest.fixture(scope="module")
def requests_(adapters) -> dict[str | None, LoRARequest | None]:
    reqs: dict[str | None, LoRARequest | None] = {
        name: LoRARequest(name, IDS[name], path) for name, path in adapters.items()
    }
    reqs[None] = None
    return reqs


@pytest.fixture(scope="module")
def hf(tiny_model_dirs, adapters):
    """adapter name (None: base) -> HF + PEFT greedy ids of PROMPTS, computed once each."""
    cache: dict[str | None, list[list[int]]] = {}

    def get(name: str | None) -> list[list[int]]:
        if name not in cache:
            path = adapters[name] if name is not None else None
            cache[name] = lora_adapters.hf_lora_greedy(
                tiny_model_dirs[KIND], path, PROMPTS, MAX_TOKENS
            )
        return cache[name]

    return get


def check(llm: LLM, outs: list[Any], expected: list[list[int]], what: str) -> None:
    tokenizer = llm.get_tokenizer()
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref, f"{what}: prompt {out.prompt!r}"
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


def mixed(names: list[str | None]) -> list[tuple[str, str | None, int]]:
    """(prompt, adapter, prompt index) for every prompt under every adapter, interleaved."""
    return [(p, n, i) for i, p in enumerate(PROMPTS) for n in names]


def check_mixed(llm: LLM, names: list[str | None], requests_, hf) -> None:
    """One generate call mixing the adapters (and the base model) request by request."""
    rows = mixed(names)
    outs = llm.generate(
        [p for p, _, _ in rows],
        GREEDY,
        lora_request=[requests_[n] for _, n, _ in rows],
        use_tqdm=False,
    )
    for out, (_, name, index) in zip(outs, rows):
        check(llm, [out], [hf(name)[index]], f"adapter {name} in a mixed batch")


# -- PP = 1 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm1(tiny_model_dirs):
    llm = engine(tiny_model_dirs[KIND], max_cpu_loras=3, enable_prefix_caching=True)
    yield llm
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("name", ["a4", "b8", "c8", None])
def test_each_adapter_equals_hf_peft(llm1, requests_, hf, name) -> None:
    outs = llm1.generate(PROMPTS, GREEDY, lora_request=requests_[name], use_tqdm=False)
    check(llm1, outs, hf(name), f"adapter {name}")


@pytest.mark.parametrize("name", ["a4", "c8"])
def test_each_adapter_equals_the_merged_model(llm1, requests_, tiny_model_dirs, adapters, name):
    # The adapter folded into the base weights (W + s * B A, PEFT's merge_and_unload) gives the
    # same greedy tokens as the unmerged update the engine applies.
    merged = lora_adapters.hf_lora_greedy(
        tiny_model_dirs[KIND], adapters[name], PROMPTS, MAX_TOKENS, merged=True
    )
    outs = llm1.generate(PROMPTS, GREEDY, lora_request=requests_[name], use_tqdm=False)
    check(llm1, outs, merged, f"adapter {name} against the merged model")


def test_adapters_change_the_outputs(hf) -> None:
    # Otherwise equality with HF would prove nothing about the update.
    for name in ("a4", "b8", "c8"):
        assert hf(name) != hf(None), name


def test_mixed_batch_of_three_adapters_and_base(llm1, requests_, hf) -> None:
    # Also: the prefix cache (on) holds the same prompts under four adapters at once.
    check_mixed(llm1, ["a4", None, "b8", "c8"], requests_, hf)
    assert llm1.llm_engine.list_loras() >= {IDS["a4"], IDS["b8"], IDS["c8"]}


def test_add_list_remove(llm1, requests_, hf) -> None:
    engine_ = llm1.llm_engine
    request = requests_["d4"]
    assert engine_.add_lora(request) is True
    assert engine_.add_lora(request) is False
    assert IDS["d4"] in engine_.list_loras()
    assert engine_.remove_lora(IDS["d4"]) is True
    assert engine_.remove_lora(IDS["d4"]) is False
    assert IDS["d4"] not in engine_.list_loras()
    # Used again: registered again on first use.
    outs = llm1.generate(PROMPTS[:1], GREEDY, lora_request=request, use_tqdm=False)
    assert outs[0].outputs[0].token_ids != hf(None)[0]


# -- slots and CPU cache: max_loras=1, max_cpu_loras=1 ----------------------------------------


def test_one_slot_swaps_and_finishes_everything(tiny_model_dirs, requests_, hf) -> None:
    # Chunked prefill (the other scheduling policy), prompts cut into 16-token chunks.
    llm = engine(
        tiny_model_dirs[KIND],
        max_loras=1,
        max_cpu_loras=1,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=16,
    )
    try:
        check_mixed(llm, ["a4", "b8", None, "c8"], requests_, hf)
        manager = llm.llm_engine.executor.worker.model_runner.lora_manager
        assert len(manager.cache) == 1  # the others were evicted and read again from disk
    finally:
        llm.llm_engine.shutdown()


def test_speculation_keeps_each_adapters_outputs(tiny_model_dirs, requests_, hf) -> None:
    """n-gram speculation with adapters: the target verifies drafts with each request's
    adapter, so a mixed batch still equals HF + PEFT, and drafts were really accepted."""
    from prometheus_client import REGISTRY

    model = tiny_model_dirs[KIND]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    llm = engine(model, speculative_config=spec, disable_log_stats=False)

    def accepted() -> float:
        labels = {"model_name": model}
        return REGISTRY.get_sample_value("vllm:spec_decode_num_accepted_tokens_total", labels) or 0

    before = accepted()
    try:
        check_mixed(llm, ["a4", None, "b8"], requests_, hf)
    finally:
        llm.llm_engine.shutdown()
    assert accepted() - before >= 10


# -- pipeline and tensor parallelism ----------------------------------------------------------


@pytest.mark.parametrize(
    "tp,pp",
    [(1, 2), (1, 3), (2, 1)],
    ids=["pp2", "pp3", "tp2"],
)
def test_parallel_mp(tiny_model_dirs, requests_, hf, tp, pp) -> None:
    llm = engine(
        tiny_model_dirs[KIND],
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
    )
    try:
        check_mixed(llm, ["a4", None, "b8"], requests_, hf)
        outs = llm.generate(PROMPTS, GREEDY, lora_request=requests_["c8"], use_tqdm=False)
        check(llm, outs, hf("c8"), "c8")
    finally:
        llm.llm_engine.shutdown()


def test_replaced_stage_reloads_adapters(tiny_model_dirs, requests_, hf) -> None:
    """A stage killed mid-generation is respawned; the engine sends it the registered adapters
    again, and every request finishes with its adapter's tokens."""
    import time

    llm = engine(tiny_model_dirs[KIND], pipeline_parallel_size=2, distributed_executor_backend="mp")
    try:
        engine_ = llm.llm_engine
        rows = mixed(["a4", "b8", None])
        for i, (prompt, name, _) in enumerate(rows):
            engine_.add_request(str(i), prompt, GREEDY, lora_request=requests_[name])
        finished = {}
        for _ in range(3):
            finished.update((o.request_id, o) for o in engine_.step() if o.finished)
        victim = engine_.executor.procs[1]
        victim.kill()
        deadline = time.monotonic() + 120
        while engine_.has_unfinished_requests() and time.monotonic() < deadline:
            finished.update((o.request_id, o) for o in engine_.step() if o.finished)
        assert len(engine_.fault_events) == 1
        for i, (_, name, index) in enumerate(rows):
            assert list(finished[str(i)].outputs[0].token_ids) == hf(name)[index], (name, index)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.ray
def test_tp2_pp2_ray(ray_session, tiny_model_dirs, requests_, hf) -> None:
    llm = engine(
        tiny_model_dirs[KIND],
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
    )
    try:
        check_mixed(llm, ["a4", "c8", None], requests_, hf)
    finally:
        llm.llm_engine.shutdown()


# -- other families ----------------------------------------------------------------------------

FAMILY_TARGETS = {
    "opt-pre": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "qwen2": lora_adapters.LLAMA_TARGETS,
    # Phi-3's checkpoints (and so its PEFT adapters) fuse q/k/v and gate/up.
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}


@pytest.mark.parametrize("kind", list(FAMILY_TARGETS))
def test_families(kind, tiny_model_dirs, tmp_path_factory) -> None:
    root = str(tmp_path_factory.mktemp(f"lora_{kind}"))
    if kind in tiny_model_dirs:
        model_dir = tiny_model_dirs[kind]
    else:
        tok_dir = os.path.join(os.path.dirname(tiny_model_dirs[KIND]), "tokenizer")
        model_dir = family_models.build_family(kind, os.path.join(root, "model"), tok_dir)
    paths = [
        lora_adapters.make_adapter(
            model_dir, os.path.join(root, f"r{rank}"), rank, 2 * rank, FAMILY_TARGETS[kind],
            seed=rank,
        )
        for rank in (4, 8)
    ]  # fmt: skip
    expected = [lora_adapters.hf_lora_greedy(model_dir, p, PROMPTS, MAX_TOKENS) for p in paths]
    llm = engine(model_dir, pipeline_parallel_size=2, distributed_executor_backend="mp")
    try:
        reqs = [LoRARequest(f"r{i}", i + 1, p) for i, p in enumerate(paths)]
        outs = llm.generate(
            PROMPTS * 2, GREEDY, lora_request=[reqs[0]] * 4 + [reqs[1]] * 4, use_tqdm=False
        )
        check(llm, outs, expected[0] + expected[1], kind)
    finally:
        llm.llm_engine.shutdown()


# -- errors ------------------------------------------------------------------------------------


def test_lora_request_without_enable_lora(tiny_model_dirs, requests_) -> None:
    llm = LLM(tiny_model_dirs[KIND], kv_cache_space=0.05, swap_space=0.01)
    try:
        with pytest.raises(ValueError, match="but LoRA is not enabled!"):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=requests_["a4"], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.llm_engine.shutdown()


def test_bad_adapters(llm1, tiny_model_dirs, tmp_path) -> None:
    model_dir = tiny_model_dirs[KIND]
    big = lora_adapters.make_adapter(model_dir, str(tmp_path / "r16"), 16, 16, ["q_proj"])
    with pytest.raises(ValueError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        llm1.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("big", 90, big))
    saved = lora_adapters.make_adapter(
        model_dir, str(tmp_path / "mts"), 4, 8, ["q_proj"], modules_to_save=["lm_head"]
    )
    with pytest.raises(ValueError, match="modules_to_save"):
        llm1.llm_engine.add_lora(LoRARequest("mts", 91, saved))
    embed = lora_adapters.make_adapter(model_dir, str(tmp_path / "emb"), 4, 8, ["embed_tokens"])
    with pytest.raises(ValueError, match="expected target modules in"):
        llm1.llm_engine.add_lora(LoRARequest("emb", 92, embed))
    with pytest.raises(ValueError, match="No adapter found"):
        llm1.llm_engine.add_lora(LoRARequest("missing", 93, str(tmp_path / "nowhere")))
    assert not llm1.llm_engine.list_loras() & {90, 91, 92, 93}
    assert not llm1.llm_engine.has_unfinished_requests()
    # The engine still serves.
    outs = llm1.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == MAX_TOKENS


def test_bad_requests(llm1, requests_) -> None:
    with pytest.raises(ValueError, match="id must be > 0"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="lora_path cannot be empty"):
        LoRARequest("x", 1)
    with pytest.raises(ValueError, match="lengths of prompts and lora_request"):
        llm1.generate(PROMPTS, GREEDY, lora_request=[requests_["a4"]], use_tqdm=False)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm1.generate(PROMPTS[:1], GREEDY, lora_request="a4", use_tqdm=False)  # type: ignore[arg-type]
    clash = LoRARequest("other-name", IDS["a4"], requests_["a4"].lora_path)
    with pytest.raises(ValueError, match="is registered as adapter"):
        llm1.generate(PROMPTS[:1], GREEDY, lora_request=clash, use_tqdm=False)


def test_lora_config_errors() -> None:
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoRAConfig(max_lora_rank=12)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3


# -- scheduling and prefix caching (no torch) ---------------------------------------------------


def _group(rid: str, lora_id: int, tokens: list[int] | None = None) -> SequenceGroup:
    seq = Sequence(int(rid), "p", tokens or [1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    lora = LoRARequest(f"l{lora_id}", lora_id, "/x") if lora_id else None
    return SequenceGroup(rid, [seq], SamplingParams(), arrival_time=0.0, lora_request=lora)


def test_admission_never_exceeds_max_loras() -> None:
    admission = LoRAAdmission(2)
    running = [_group("1", 1), _group("2", 2), _group("3", 0)]
    assert admission.allows(_group("4", 1), running)  # its adapter runs already
    assert admission.allows(_group("5", 0), running)  # the base model needs no slot
    assert not admission.allows(_group("6", 3), running)
    assert admission.allows(_group("7", 3), running[1:])
    assert LoRAAdmission(None).allows(_group("8", 9), running)


def test_prefix_cache_keys_include_the_adapter() -> None:
    bm = BlockSpaceManager(4, 16, 4, watermark=0.0, enable_caching=True)
    tokens = list(range(12))
    base = bm._block_hashes(tokens)
    one = bm._block_hashes(tokens, 1)
    two = bm._block_hashes(tokens, 2)
    assert len(base) == 3
    assert not set(base) & set(one) and not set(one) & set(two)
    assert bm._block_hashes(tokens, 1) == one


# -- Ray Data's predictor (called directly: the same code runs in map_batches actors) -----------


def test_batch_predictor_passes_lora_requests(tiny_model_dirs, adapters, hf) -> None:
    import numpy as np

    from vllm.batch.predictor import LLMPredictor

    predictor = LLMPredictor(
        tiny_model_dirs[KIND],
        sampling_params={"temperature": 0.0, "max_tokens": MAX_TOKENS},
        engine_kwargs=dict(
            enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_space=0.05, swap_space=0.01
        ),
    )
    try:
        loras = [
            {"lora_name": "a4", "lora_int_id": IDS["a4"], "lora_path": adapters["a4"]},
            None,
            LoRARequest("b8", IDS["b8"], adapters["b8"]),
            {"lora_name": "bad", "lora_int_id": 0, "lora_path": adapters["a4"]},
        ]
        out = predictor(
            {"prompt": np.array(PROMPTS[:4]), "lora_request": np.array(loras, dtype=object)}
        )
        tokenizer = predictor.llm.get_tokenizer()
        for i, name in enumerate(["a4", None, "b8"]):
            assert out["error"][i] == ""
            expected = tokenizer.decode(hf(name)[i], skip_special_tokens=True)
            assert out["generated_text"][i] == expected, name
        assert "id must be > 0" in out["error"][3]
    finally:
        predictor.shutdown()


# -- the batched update itself, against a per-token loop -----------------------------------------


@pytest.mark.parametrize("pattern", [[0], [2], [-1], [0, 1, -1, 2], [3, -1, -1, 1], [1, 1, 0]])
def test_grouped_update_equals_per_token_loop(pattern: list[int]) -> None:
    import torch

    from vllm.lora.layers import LoRAContext, LoRALinear
    from vllm.model_executor.layers.linear import QKVParallelLinear

    torch.manual_seed(0)
    base = QKVParallelLinear(32, 8, 4, 2, bias=True)  # q 32, k 16, v 16 rows
    torch.nn.init.normal_(base.weight, std=0.1)
    torch.nn.init.normal_(base.bias, std=0.1)
    context = LoRAContext()
    layer = LoRALinear(base, ("q", "k", "v"), [32, 16, 16], context, 4, 8, torch.float32, "cpu")
    weights = {}
    for slot, rank in enumerate([4, 8, 2, 8]):
        # Slot 2 adapts q and v only.
        parts = [0, 2] if slot == 2 else [0, 1, 2]
        w = {i: (torch.randn(rank, 32), torch.randn([32, 16, 16][i], rank)) for i in parts}
        layer.set_slot(slot, w, 0.5 + slot)
        weights[slot] = w
    slots = [pattern[i % len(pattern)] for i in range(11)]
    x = torch.randn(11, 32)
    context.set_tokens(torch.tensor(slots))
    got = layer(x)
    expected = base(x)
    offsets = [0, 32, 48]
    for t, slot in enumerate(slots):
        for i, (a, b) in weights.get(slot, {}).items():
            rows = slice(offsets[i], offsets[i] + b.shape[0])
            expected[t, rows] += (x[t] @ a.t() @ b.t()) * (0.5 + slot)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
