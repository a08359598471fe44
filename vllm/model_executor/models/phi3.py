"""Phi-3: the LLaMA decoder whose checkpoint holds q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` (each TP rank reads its rows of every part: `LlamaForCausalLM.weight_shard`),
with longrope scaling for the long-context variants and partial rotary when configured."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """One pipeline stage of a Phi-3 causal LM (no biases; the fused tensors load as they are)."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions()
