"""The decode fast path's one-op layer (csrc/decode_layer.cpp, `decode_layer_gguf`): a LLaMA
layer whose four matmuls are GGUF blocks runs its kernels from C++ in one op. It must give
what the same kernels called one by one from Python give, bit for bit (greedy ids and every
logprob), with float and with int8 activations, for one prompt and a batch; and it must
actually run."""

from __future__ import annotations

import pytest

from tests.utils import family_models, tiny_models
from vllm import LLM, SamplingParams
from vllm import _custom_ops as ops
from vllm.model_executor.models import llama_decode

pytestmark = pytest.mark.skipif(not ops.is_available(), reason="C++ kernels not built")

PROMPTS = tiny_models.PROMPTS[:3]
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=3)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(GGUF path, tokenizer): a tiny LLaMA 3 with Q4_1 layers and Q8_0 embedding/lm_head."""
    root = str(tmp_path_factory.mktemp("layer_op"))
    llama3 = tiny_models.build_dirs(root, ("llama3",), family_models.build_family)["llama3"]
    path = family_models.write_gguf(
        llama3, f"{root}/tiny-q4_1.gguf", "llama3", None, family_models.quantize_as_shipped
    )
    return path, llama3


def generate(llm: LLM) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """(greedy ids, each token's top logprobs): each prompt alone, then all as one batch."""
    outs = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in PROMPTS]
    outs += llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [{t: lp.logprob for t, lp in entry.items()} for entry in o.outputs[0].logprobs or []]
        for o in outs
    ]
    return ids, logprobs


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_layer_op_equals_kernel_by_kernel(activations, gguf_model, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_PP_GGUF_ACTIVATIONS", activations)
    path, tokenizer = gguf_model
    llm = LLM(path, tokenizer=tokenizer, kv_cache_space=0.05, swap_space=0.01)
    try:
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)  # binds the kernels, builds plans
        calls = [0]
        op = llama_decode._decode_layer
        assert op is not None, "the built extension has no decode_layer_gguf"

        def counted(*args):  # type: ignore[no-untyped-def]
            calls[0] += 1
            return op(*args)

        monkeypatch.setattr(llama_decode, "_decode_layer", counted)
        one_op = generate(llm)
        assert calls[0] > 0
        monkeypatch.setattr(llama_decode, "USE_LAYER_OP", False)
        calls[0] = 0
        by_kernel = generate(llm)
        assert calls[0] == 0
    finally:
        llm.shutdown()
    assert one_op[0] == by_kernel[0]
    assert one_op[1] == by_kernel[1]  # bit-equal floats
