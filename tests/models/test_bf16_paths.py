"""bf16 (and fp32) on any x86-64 CPU: linear layers prepack for oneDNN only where oneDNN can
(bf16 needs avx512bw/vl/dq or avx_ne_convert), otherwise plain matmuls. Both paths run on
whatever machine runs the tests: the fallback forced by VLLM_CPU_PACKED_LINEAR=0, and an
AVX2-only CPU simulated by a failed oneDNN probe."""

from __future__ import annotations

import pytest
import torch

from tests.utils import tiny_models
from vllm import LLM, SamplingParams
from vllm.model_executor.layers import linear, packed_weight

KIND = "llama-gqa-untied"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
AVX2_ERROR = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
    "avx512bw, avx512vl and avx512dq"
)


def _generate(path: str) -> tuple[list[list[int]], str]:
    llm = LLM(path, dtype="bfloat16", kv_cache_space=0.05, swap_space=0.01)
    try:
        outs = llm.generate(tiny_models.PROMPTS, GREEDY, use_tqdm=False)
        path_used = llm.llm_engine.executor.worker.model_runner.model.linear_path
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], path_used


@pytest.fixture(scope="module")
def hf_bf16(tiny_model_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dirs[KIND]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tiny_models.hf_greedy_with(model, tokenizer, tiny_models.PROMPTS, 24)


def _token_agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    same = sum(a == b for x, y in zip(ours, ref) for a, b in zip(x, y))
    return same / sum(len(y) for y in ref)


def test_linear_path_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("VLLM_CPU_PACKED_LINEAR", "0")
    assert linear.linear_path(cpu, torch.bfloat16) == (
        False,
        "plain matmul (VLLM_CPU_PACKED_LINEAR=0)",
    )
    monkeypatch.setenv("VLLM_CPU_PACKED_LINEAR", "1")
    monkeypatch.setitem(packed_weight._PACK_PROBES, torch.bfloat16, AVX2_ERROR)
    packed, why = linear.linear_path(cpu, torch.bfloat16)
    assert not packed and "oneDNN cannot prepack torch.bfloat16 on this CPU" in why
    assert not linear.linear_path(cpu, torch.float16)[0]  # oneDNN prepack is fp32/bf16 only


def test_bf16_plain_path_when_onednn_cannot_prepack(tiny_model_dirs, hf_bf16, monkeypatch):
    """An AVX2-only CPU (oneDNN refuses bf16 reorders): the engine loads bf16 with plain
    matmuls, says so, and generates what the forced fallback generates; where this CPU can
    prepack, the prepacked path generates the same tokens."""
    path = tiny_model_dirs[KIND]
    monkeypatch.setitem(packed_weight._PACK_PROBES, torch.bfloat16, AVX2_ERROR)
    simulated, used = _generate(path)
    assert used.startswith("plain matmul (oneDNN cannot prepack")
    monkeypatch.delitem(packed_weight._PACK_PROBES, torch.bfloat16)
    monkeypatch.setenv("VLLM_CPU_PACKED_LINEAR", "0")
    forced, used = _generate(path)
    assert used == "plain matmul (VLLM_CPU_PACKED_LINEAR=0)"
    assert simulated == forced
    # bf16 drifts from HF's bf16 on a tiny random model (near-flat logits), but a broken path
    # would agree on almost nothing: 79% of the tokens agree on this model.
    assert _token_agreement(forced, hf_bf16) > 0.6
    monkeypatch.setenv("VLLM_CPU_PACKED_LINEAR", "1")
    if linear.linear_path(torch.device("cpu"), torch.bfloat16)[0]:
        packed, used = _generate(path)
        assert used.startswith("oneDNN prepacked")
        assert packed == forced
