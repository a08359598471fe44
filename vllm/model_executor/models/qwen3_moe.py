"""Qwen3-MoE: LLaMA's stage skeleton with Qwen3's attention (per-head q and k RMSNorm before
rope, `head_dim` independent of hidden / heads) and sparse MoE feed-forward blocks (top-k of
`num_experts`, renormalised only when `norm_topk_prob`); `mlp_only_layers` and
`decoder_sparse_step` keep some layers dense. Holds only this stage's layers.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vllm.model_executor.layers.fused_moe import SparseMoeBlock
from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM
from vllm.model_executor.models.mixtral import MoEWeightsMixin
from vllm.model_executor.models.utils import StageLayout


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """HF's rule: sparse unless listed in `mlp_only_layers`, every `decoder_sparse_step`."""
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    return layer_idx not in only_mlp and num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeForCausalLM(MoEWeightsMixin, LlamaForCausalLM):
    """One pipeline stage of a Qwen3-MoE causal LM."""

    def __init__(self, config: Any, layout: StageLayout) -> None:
        self.moe_intermediate_size = config.moe_intermediate_size
        super().__init__(config, layout)

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        """Qwen3's attention: per-head q/k RMSNorm before the rope; `attention_bias` on all."""
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        cfg = self.config
        if not is_moe_layer(cfg, layer_idx):
            return None  # LLaMA's MLP with the dense intermediate_size
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            getattr(cfg, "num_experts", None) or cfg.num_local_experts,
            cfg.num_experts_per_tok,
            renormalize=bool(cfg.norm_topk_prob),
            hidden_act=getattr(cfg, "hidden_act", "silu"),
            weights_in_input_dtype=True,  # HF rounds the routing weights to the hidden dtype
        )
