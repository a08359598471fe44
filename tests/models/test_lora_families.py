"""Multi-LoRA on every other family the engine runs: Mistral, Qwen3 (q/k norm), Gemma 2,
Gemma 3 (text), Mixtral and Qwen3-MoE. For each, PEFT adapters of ranks 4 and 8 (random
non-zero A and B, so they change HF's output) on q/k/v/o and gate/up/down where the family
has them; one engine serves both adapters and the base model in one mixed batch, and every
request's greedy ids and text equal HF transformers + PEFT (`PeftModel`), at PP 1 and at PP 2
or TP 2 (mp). MoE families: LoRA on attention and on Qwen3-MoE's dense `mlp_only_layers`
works; adapters of the experts or the router are refused at load with a ValueError naming
the module (vLLM has no expert LoRA either), in every form users meet: PEFT's stacked-expert
`target_parameters` (what PEFT makes today for `gate_proj`/`w1` targets), transformers 4's
per-expert `experts.N.w1` / `experts.N.gate_proj` linears, the router `gate`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.utils import family_models, lora_adapters, tiny_gemma, tiny_models, tiny_moe
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PROMPTS = tiny_models.PROMPTS[:3]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class Family:
    """How to build one tiny family model and its adapters, and where to run it besides PP 1."""

    build: Callable[[str, str, str], str]  # (kind, out_dir, tokenizer_dir) -> out_dir
    targets: list[str]
    parallel: dict[str, int]  # the second engine's tensor/pipeline sizes
    load: Callable[[str], Any] | None = None  # HF oracle loader (None: tiny_models.load_hf)

    def modules(self) -> set[str]:
        """The HF modules (after `model.layers.N.`) its adapters must hold."""
        return {f"{'self_attn' if t in ATTENTION else 'mlp'}.{t}" for t in self.targets}


PP2 = {"pipeline_parallel_size": 2}
TP2 = {"tensor_parallel_size": 2}
FAMILIES = {
    "mistral": Family(family_models.build_family, lora_adapters.LLAMA_TARGETS, TP2),
    "qwen3": Family(family_models.build_family, lora_adapters.LLAMA_TARGETS, PP2),
    "gemma2": Family(tiny_gemma.build_gemma, lora_adapters.LLAMA_TARGETS, PP2, tiny_gemma.load_hf),
    "gemma3": Family(tiny_gemma.build_gemma, lora_adapters.LLAMA_TARGETS, TP2, tiny_gemma.load_hf),
    "mixtral": Family(tiny_moe.build_moe, ATTENTION, PP2),
    # gate/up/down exist only in the dense layer 2 (the experts are refused, below).
    "qwen3_moe": Family(tiny_moe.build_moe, lora_adapters.LLAMA_TARGETS, TP2),
}
MOE = ("mixtral", "qwen3_moe")
# name -> (rank, lora_alpha, use_rslora, seed)
ADAPTERS = {"r4": (4, 8, False, 1), "r8": (8, 16, True, 2)}
IDS = {"r4": 1, "r8": 2}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("lora_families"))


@pytest.fixture(scope="module")
def model_dir(root, tiny_model_dirs) -> Callable[[str], str]:
    """kind -> its tiny model's directory (built on first use, SmolLM2-style tokenizer)."""
    tok_dir = os.path.join(os.path.dirname(tiny_model_dirs["llama-gqa-untied"]), "tokenizer")
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = FAMILIES[kind].build(kind, os.path.join(root, kind), tok_dir)
        return built[kind]

    return get


@pytest.fixture(scope="module")
def adapters(root, model_dir) -> Callable[[str], dict[str, str]]:
    """kind -> {adapter name: directory}, made on first use."""
    made: dict[str, dict[str, str]] = {}

    def get(kind: str) -> dict[str, str]:
        if kind not in made:
            family = FAMILIES[kind]
            made[kind] = {}
            with lora_adapters.peft_targets_as_named():
                for name, (rank, alpha, rslora, seed) in ADAPTERS.items():
                    made[kind][name] = lora_adapters.make_adapter(
                        model_dir(kind),
                        os.path.join(root, f"{kind}-{name}"),
                        rank,
                        alpha,
                        family.targets,
                        rslora,
                        seed,
                        load=family.load,
                    )
        return made[kind]

    return get


@pytest.fixture(scope="module")
def hf(model_dir, adapters) -> Callable[[str, str | None], list[list[int]]]:
    """(kind, adapter name or None) -> HF + PEFT greedy ids of PROMPTS, computed once."""
    cache: dict[tuple[str, str | None], list[list[int]]] = {}

    def get(kind: str, name: str | None) -> list[list[int]]:
        if (kind, name) not in cache:
            path = adapters(kind)[name] if name is not None else None
            with lora_adapters.peft_targets_as_named():
                cache[kind, name] = lora_adapters.hf_lora_greedy(
                    model_dir(kind), path, PROMPTS, MAX_TOKENS, load=FAMILIES[kind].load
                )
        return cache[kind, name]

    return get


def engine(path: str, **kwargs: Any) -> LLM:
    return LLM(
        path,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kv_cache_space=0.05,
        swap_space=0.01,
        **kwargs,
    )


def check_mixed(llm: LLM, kind: str, adapters: dict[str, str], hf: Any) -> None:
    """Both adapters and the base model, interleaved request by request in one batch."""
    rows = [(p, n, i) for i, p in enumerate(PROMPTS) for n in ("r4", None, "r8")]
    reqs = {n: LoRARequest(f"{kind}-{n}", IDS[n], adapters[n]) for n in ADAPTERS}
    outs = llm.generate(
        [p for p, _, _ in rows],
        GREEDY,
        lora_request=[reqs[n] if n else None for _, n, _ in rows],
        use_tqdm=False,
    )
    tokenizer = llm.get_tokenizer()
    for out, (_, name, index) in zip(outs, rows):
        expected = hf(kind, name)[index]
        assert out.outputs[0].token_ids == expected, f"{kind} adapter {name}, prompt {index}"
        assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)


# -- the adapters ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_adapters_target_the_family_and_change_hf(kind, adapters, hf) -> None:
    # Otherwise equality with HF would prove nothing about the update.
    from safetensors import safe_open

    for name, path in adapters(kind).items():
        with safe_open(os.path.join(path, "adapter_model.safetensors"), "pt") as f:
            modules = {k.split(".layers.", 1)[1].split(".", 1)[1] for k in f.keys()}
        wanted = {f"{m}.lora_{p}.weight" for m in FAMILIES[kind].modules() for p in "AB"}
        assert modules == wanted, (kind, name)
        assert hf(kind, name) != hf(kind, None), (kind, name)


# -- greedy ids and text equal HF + PEFT ----------------------------------------------------------


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_pp1_equals_hf_peft(kind, model_dir, adapters, hf) -> None:
    llm = engine(model_dir(kind))
    try:
        check_mixed(llm, kind, adapters(kind), hf)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(k, id=f"{k}-{'tp2' if FAMILIES[k].parallel == TP2 else 'pp2'}")
        for k in FAMILIES
    ],
)
def test_parallel_equals_hf_peft(kind, model_dir, adapters, hf) -> None:
    llm = engine(model_dir(kind), distributed_executor_backend="mp", **FAMILIES[kind].parallel)
    try:
        check_mixed(llm, kind, adapters(kind), hf)
    finally:
        llm.llm_engine.shutdown()


# -- MoE: adapters of the experts or the router are refused -------------------------------------


def _legacy_adapter(kind: str, path: str, module: str, out_features: int) -> str:
    """A transformers 4 style adapter, whose experts and router were linears: layer 0's q_proj
    plus `module` (e.g. Mixtral's `model.layers.3.block_sparse_moe.experts.0.w1`)."""
    gen = torch.Generator().manual_seed(5)
    q_rows = 4 * (32 if kind == "qwen3_moe" else 16)  # heads * head_dim
    modules = {
        "model.layers.0.self_attn.q_proj": (
            0.1 * torch.randn(4, tiny_moe.H, generator=gen),
            0.05 * torch.randn(q_rows, 4, generator=gen),
        ),
        module: (
            0.1 * torch.randn(4, tiny_moe.H, generator=gen),
            0.05 * torch.randn(out_features, 4, generator=gen),
        ),
    }
    return lora_adapters.write_adapter(path, modules, 4, ["q_proj", module.rsplit(".", 1)[1]])


# Per-expert linears and routers as transformers 4 named them.
LEGACY = {
    "mixtral": [
        ("model.layers.3.block_sparse_moe.experts.0.w1", tiny_moe.INTER),
        ("model.layers.1.block_sparse_moe.gate", tiny_moe.EXPERTS),
    ],
    "qwen3_moe": [
        # gate_proj is a module the engine adapts (in the dense layer 2), not in an expert.
        ("model.layers.3.mlp.experts.0.gate_proj", tiny_moe.INTER),
        ("model.layers.1.mlp.gate", 8),
    ],
}


@pytest.mark.parametrize("kind", MOE)
def test_expert_adapters_are_refused(kind, model_dir, tmp_path) -> None:
    directory = model_dir(kind)
    cases = [
        (_legacy_adapter(kind, str(tmp_path / f"legacy{i}"), module, rows), module)
        for i, (module, rows) in enumerate(LEGACY[kind])
    ]
    # What PEFT makes today of expert and router targets: `target_parameters`, the stacked
    # expert weights (and the router's).
    targets = ["w1", "w2", "w3", "gate"] if kind == "mixtral" else lora_adapters.LLAMA_TARGETS
    peft_experts = lora_adapters.make_adapter(directory, str(tmp_path / "peft"), 4, 8, targets)
    cases.append((peft_experts, "target_parameters"))
    llm = engine(directory)
    try:
        engine_ = llm.llm_engine
        for lora_id, (path, named) in enumerate(cases, start=10):
            with pytest.raises(ValueError, match="expert LoRA is not supported") as info:
                engine_.add_lora(LoRARequest(f"bad{lora_id}", lora_id, path))
            assert named in str(info.value)
        assert not engine_.list_loras()
        # The engine still serves, with and without an adapter.
        good = LoRARequest("good", 1, str(tmp_path / "good"))
        lora_adapters.make_adapter(directory, good.lora_path, 4, 8, ["q_proj", "o_proj"], seed=3)
        for lora in (None, good):
            outs = llm.generate(PROMPTS[:1], GREEDY, lora_request=lora, use_tqdm=False)
            assert len(outs[0].outputs[0].token_ids) == MAX_TOKENS
    finally:
        llm.llm_engine.shutdown()


def test_expert_adapter_refused_by_every_stage(model_dir, tmp_path) -> None:
    """At PP 2 the expert module of layer 3 lives on stage 1 only; the adapter is refused all
    the same and no stage keeps it."""
    module, rows = LEGACY["mixtral"][0]
    path = _legacy_adapter("mixtral", str(tmp_path / "legacy"), module, rows)
    llm = engine(model_dir("mixtral"), distributed_executor_backend="mp", **PP2)
    try:
        with pytest.raises(ValueError, match="experts.0.w1.*expert LoRA is not supported"):
            llm.llm_engine.add_lora(LoRARequest("legacy", 7, path))
        assert not llm.llm_engine.list_loras()
    finally:
        llm.llm_engine.shutdown()
