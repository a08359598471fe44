"""Mixtral: LLaMA's attention, norms and stage skeleton with a sparse MoE feed-forward block
(top-2 of 8 experts, renormalised routing weights), holding only this stage's layers.

`MoEWeightsMixin` is the MoE part any LLaMA-shaped family reuses (Qwen3-MoE): the feed-forward
hook, the experts' TP shards and the loading of router and expert tensors, per-expert or stacked.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe import (
    SparseMoeBlock,
    moe_weight_shard,
    parse_expert_name,
)
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.utils import Shard, StageLayout

# A stage-local MoE tensor: layer prefix, then what lies below the block. Mixtral checkpoints
# name the block `block_sparse_moe`, transformers' in-memory modules (and Qwen3-MoE) `mlp`.
_MOE_RE = re.compile(
    r"^(model\.layers\.(\d+))\.(?:block_sparse_moe|mlp)\.(gate\.weight|experts\..+)$"
)


class MoEWeightsMixin:
    """For a LlamaForCausalLM subclass whose MoE layers' `mlp` is a SparseMoeBlock.

    Subclasses set `moe_intermediate_size` (one expert's intermediate size) and build the
    blocks in `make_mlp`."""

    moe_intermediate_size: int
    model: Any

    def weight_shard(self, name: str) -> Shard | None:
        """Expert tensors split like an MLP's; the router replicated; the rest as LLaMA."""
        if _MOE_RE.search(name) is not None:
            return moe_weight_shard(name, self.moe_intermediate_size)
        return super().weight_shard(name)  # type: ignore[misc]

    def load_other_weight(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
    ) -> str | None:
        """Router and expert tensors into their layer's SparseMoeBlock (`name` stage-local)."""
        match = _MOE_RE.match(name)
        if match is None:
            return None
        prefix, layer, suffix = match.group(1), int(match.group(2)), match.group(3)
        block = self.model.layers[layer].mlp
        if not isinstance(block, SparseMoeBlock):
            return None  # a dense layer (Qwen3-MoE's mlp_only_layers): LLaMA's loading
        loaded = block.load_weight(suffix, tensor, name)
        if loaded is None:
            raise ValueError(f"unexpected weight {name!r} in the checkpoint.")
        parsed = parse_expert_name("." + suffix)
        if parsed is None:
            self._moe_pieces.add((layer, "gate", -1))
        else:
            part, expert = parsed
            experts = range(block.experts.num_experts) if expert is None else [expert]
            parts = ("gate", "up") if part == "gate_up" else (part,)
            self._moe_pieces.update((layer, p, e) for p in parts for e in experts)
        return f"{prefix}.mlp.{loaded}"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LLaMA's loading plus the MoE tensors; every expert of every MoE layer must come
        from the checkpoint (a parameter filled by parts counts as loaded only when whole)."""
        self._moe_pieces: set[tuple[int, str, int]] = set()
        super().load_weights(weights)  # type: ignore[misc]
        for layer, decoder_layer in enumerate(self.model.layers):
            block = decoder_layer.mlp
            if not isinstance(block, SparseMoeBlock):
                continue
            wanted = {(layer, "gate", -1)} | {
                (layer, part, e)
                for part in ("gate", "up", "down")
                for e in range(block.experts.num_experts)
            }
            missing = sorted(wanted - self._moe_pieces)
            if missing:
                _, part, expert = missing[0]
                global_layer = self.model.layout.start_layer + layer
                what = "the router" if expert < 0 else f"expert {expert}'s {part} projection"
                raise ValueError(
                    f"checkpoint is missing weights for: {what} of layer {global_layer} "
                    f"({len(missing)} MoE tensors missing)"
                )
        del self._moe_pieces


class MixtralForCausalLM(MoEWeightsMixin, LlamaForCausalLM):
    """One pipeline stage of a Mixtral causal LM."""

    def __init__(self, config: Any, layout: StageLayout) -> None:
        self.moe_intermediate_size = config.intermediate_size
        super().__init__(config, layout)

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        cfg = self.config
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            renormalize=True,  # Mixtral always renormalises the top-k weights
            hidden_act=getattr(cfg, "hidden_act", "silu"),
        )
