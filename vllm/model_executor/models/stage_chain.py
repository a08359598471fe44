"""Consecutive stage modules run as one stage: a stage that took over a lost neighbour's
layers (a shrink: `vllm.resilience.plans.shrink`) keeps the module of its own layers and
loads only the gained ones as a module of their own, instead of reloading its whole new range.

Each part keeps the layout it was built for, so the stream between two parts is the same
residual-stream row the two stages exchanged before the merge (the outputs do not change);
the first part embeds (when the chain is the first stage), the last one holds the final norm
and lm_head (when it is the last)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.layers.attention import KVCache


class StageChain(nn.Module):
    """Stage modules of consecutive layer ranges, run in order as one stage's model."""

    def __init__(self, parts: list[nn.Module], default_kv_shape: tuple[int, int]) -> None:
        """`parts`: stage modules in layer order, each with its `layout`;
        `default_kv_shape`: (KV heads, head size) of a layer whose module does not name its
        own (`kv_cache_shapes`)."""
        super().__init__()
        if not parts:
            raise ValueError("parts must hold at least one stage module.")
        self.parts = nn.ModuleList(parts)
        self.default_kv_shape = default_kv_shape
        # What the worker reports for the stage: the parts together.
        self.num_params = sum(getattr(p, "num_params", 0) for p in parts)
        self.weight_bytes = sum(getattr(p, "weight_bytes", 0) for p in parts)
        self.linear_path = getattr(parts[0], "linear_path", "")

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """(KV heads this rank caches, head size) of each layer, the parts' in order."""
        shapes: list[tuple[int, int]] = []
        for part in self.parts:
            if hasattr(part, "kv_cache_shapes"):
                shapes += list(part.kv_cache_shapes())
            else:
                shapes += [self.default_kv_shape] * part.layout.num_layers
        return shapes

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: InputMetadata,
        hidden_states: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As a stage module: input_ids [T] (first stage) or hidden_states [T, hidden];
        `kv_caches` one per layer of every part, in order; an encoder's token_type_ids [T]
        go to the part that embeds. -> [T, hidden]."""
        start = 0
        for index, part in enumerate(self.parts):
            count = part.layout.num_layers
            caches = kv_caches[start : start + count]
            start += count
            ids = input_ids if index == 0 else None
            extra = (
                {"token_type_ids": token_type_ids}
                if index == 0 and token_type_ids is not None
                else {}
            )
            hidden_states = part(ids, positions, caches, md, hidden_states=hidden_states, **extra)
        assert hidden_states is not None
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> Any:
        """The last part's lm_head (see the stage modules' `compute_logits`)."""
        return self.parts[-1].compute_logits(hidden_states)
