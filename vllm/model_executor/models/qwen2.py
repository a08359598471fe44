"""Qwen2 / Qwen2.5: the LLaMA decoder with biases on the q, k and v projections (not on the
output projection); sliding windows only on the layers `layer_types` marks."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """One pipeline stage of a Qwen2 causal LM."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)
