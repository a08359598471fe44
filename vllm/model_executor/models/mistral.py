"""Mistral: the LLaMA decoder with an explicit `head_dim` and, when configured, a sliding
window on every layer (recorded on each attention layer; see `llama.sliding_window_of`)."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """One pipeline stage of a Mistral causal LM (no biases anywhere)."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions()
