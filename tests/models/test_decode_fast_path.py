"""The decoder's decode fast path (vllm/model_executor/models/llama_decode.py): a small
decode-only step runs each layer's kernels directly. It must give the general path's results
bit for bit (greedy ids and every logprob), run where it applies (dense fp32 LLaMA and Qwen2,
a quantized GGUF; one prompt and a batch) and step aside where it does not (Qwen3's q/k norms,
the kernels disabled)."""

from __future__ import annotations

import pytest

from tests.utils import family_models, tiny_models
from tests.utils.kernel_env import set_kernels
from vllm import LLM, SamplingParams
from vllm import _custom_ops as ops
from vllm.model_executor.models import llama, llama_decode

pytestmark = pytest.mark.skipif(not ops.is_available(), reason="C++ kernels not built")

PROMPTS = tiny_models.PROMPTS[:3]
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str | None]]:
    """kind -> (model, tokenizer): tiny dense LLaMA, Qwen2 and Qwen3, and a LLaMA 3 stored as
    a GGUF of Q4_1 linears and a Q8_0 embedding and lm_head."""

    root = str(tmp_path_factory.mktemp("fast_path"))
    dense = tiny_models.build_dirs(root, ("llama-gqa-untied",), tiny_models.build_model)
    families = tiny_models.build_dirs(
        root, ("qwen2", "qwen3", "llama3"), family_models.build_family
    )

    llama3 = families["llama3"]
    path = family_models.write_gguf(
        llama3, f"{root}/tiny-q4_1.gguf", "llama3", None, family_models.quantize_as_shipped
    )
    return {
        "llama": (dense["llama-gqa-untied"], None),
        "qwen2": (families["qwen2"], None),
        "qwen3": (families["qwen3"], None),
        "gguf": (path, llama3),
    }


def generate(
    model: tuple[str, str | None], fast: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[list[int]], list[list[dict[int, float]]], int]:
    """(greedy ids, each token's top logprobs, layer runs of the fast path): each prompt
    alone (batch-1 decode steps), then all at once (a batch of decodes)."""
    runs = [0]
    run = llama_decode.LayerPlan.run

    def counted(self, *args):  # type: ignore[no-untyped-def]
        runs[0] += 1
        return run(self, *args)

    with monkeypatch.context() as m:
        m.setattr(llama_decode.LayerPlan, "run", counted)
        if not fast:
            m.setattr(llama, "decode_plans", lambda *args: None)
        path, tokenizer = model
        llm = LLM(path, tokenizer=tokenizer, kv_cache_space=0.05, swap_space=0.01)
        try:
            outs = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in PROMPTS]
            outs += llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        finally:
            llm.shutdown()
    ids = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [{t: lp.logprob for t, lp in entry.items()} for entry in o.outputs[0].logprobs or []]
        for o in outs
    ]
    return ids, logprobs, runs[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gguf"])
def test_fast_path_equals_the_general_path(kind, models, monkeypatch) -> None:
    fast_ids, fast_logprobs, runs = generate(models[kind], True, monkeypatch)
    ids, logprobs, general_runs = generate(models[kind], False, monkeypatch)
    assert runs > 0 and general_runs == 0
    assert fast_ids == ids
    assert fast_logprobs == logprobs  # bit-equal floats


def test_fast_path_steps_aside(models, monkeypatch) -> None:
    """Qwen3 (per-head q/k norms) and a step with the kernels disabled take the modules."""
    _, _, runs = generate(models["qwen3"], True, monkeypatch)
    assert runs == 0
    set_kernels(monkeypatch, False)
    _, _, runs = generate(models["llama"], True, monkeypatch)
    assert runs == 0


def test_plan_follows_replaced_modules() -> None:
    """A layer whose linear was replaced (LoRA wraps them after load) gets a new plan; a
    linear without a direct call (not prepacked) leaves the layer on the general path."""
    from transformers import LlamaConfig

    from vllm.model_executor.layers.linear import ParallelLinearBase, RowParallelLinear

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=128,
        max_position_embeddings=64,
    )
    layer = llama.LlamaDecoderLayer(config)
    for module in layer.modules():
        if isinstance(module, ParallelLinearBase):
            module.pack()
    plan = llama_decode._plan_of(layer)
    assert plan is not None
    assert llama_decode._plan_of(layer) is plan  # kept while the layer is unchanged
    layer.self_attn.o_proj = RowParallelLinear(64, 64, bias=False)  # not prepacked
    assert llama_decode._plan_of(layer) is None
    packed = RowParallelLinear(64, 64, bias=False)
    packed.pack()
    layer.self_attn.o_proj = packed
    new = llama_decode._plan_of(layer)
    assert new is not None and new is not plan and new.o is not plan.o
