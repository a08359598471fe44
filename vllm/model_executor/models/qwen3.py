"""Qwen3: the LLaMA decoder with an RMSNorm over each head of q and k before the rope, a
`head_dim` independent of hidden / heads, and `attention_bias` on q/k/v/o."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """One pipeline stage of a Qwen3 (dense) causal LM."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
