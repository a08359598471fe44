"""LoRA wrappers around the model's tensor-parallel linear layers, and the step's adapter
mapping they share.

Each wrapped layer holds `max_loras` slots of stacked low-rank weights,
A [slots, n_slices * max_rank, in_local] and B [slots, out_local, n_slices * max_rank]: a fused
layer (q/k/v, gate/up) has one A/B pair per slice, A's rows one block per slice and B block
diagonal (slice i's output rows read only slice i's ranks), so the update of every slice is one
shrink and one expand matmul. An adapter of rank r < max_rank fills the first r rows of its
blocks; the rest stay zero. The update of the rows of one slot is
`((x_rows @ A[slot]^T) @ B[slot]^T) * scaling[slot]`, PEFT's order of operations; the rows are
grouped by slot once per step (`LoRAContext.set_tokens`), so a step with k adapters costs k
grouped matmul pairs per layer, whatever the number of requests.

Tensor parallelism: column-parallel layers (q/k/v, gate/up, fc1) hold B's rows of this rank's
outputs and the whole A; row-parallel layers (o, down, fc2) hold A's columns of this rank's
inputs and the whole B, and the update is added to the partial output before the all-reduce
(the sum over ranks of x_r A_r^T is x A^T).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.parallel_utils import tensor_parallel as tpu


class LoRAContext:
    """The current step's tokens grouped by adapter slot, shared by the wrapped layers of one
    stage (set before the stage's forward)."""

    def __init__(self) -> None:
        # (slot, token rows [t] of that slot, or None when every token of the step uses it).
        self.groups: list[tuple[int, Optional[torch.Tensor]]] = []

    def set_tokens(self, token_slots: torch.Tensor) -> None:
        """token_slots [T]: each token's slot, -1 for the base model."""
        self.groups = []
        if token_slots.numel() == 0:
            return
        slots = [int(s) for s in torch.unique(token_slots).tolist()]
        if slots == [-1]:
            return
        if len(slots) == 1:
            self.groups = [(slots[0], None)]
            return
        for slot in slots:
            if slot >= 0:
                rows = (token_slots == slot).nonzero().squeeze(1)  # [t]
                self.groups.append((slot, rows))

    def clear(self) -> None:
        self.groups = []


class LoRALinear(nn.Module):
    """A tensor-parallel linear layer plus the low-rank updates of the adapters in its slots.

    `slice_sizes`: this rank's output rows of each fused slice (one slice for an unfused
    layer); `slice_names`: the HF module name of each slice (q_proj, k_proj, v_proj, ...)."""

    def __init__(
        self,
        base: ParallelLinearBase,
        slice_names: tuple[str, ...],
        slice_sizes: list[int],
        context: LoRAContext,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.slice_names = slice_names
        self.slice_offsets = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]
        self.slice_sizes = slice_sizes
        self.context = context
        self.max_rank = max_rank
        self.row_parallel = isinstance(base, RowParallelLinear) and tpu.tp_size() > 1
        n = len(slice_sizes)
        in_local, out_local = base.in_features, base.out_features
        # Buffers, not parameters: the model's parameter count stays the base model's.
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, n * max_rank, in_local, dtype=dtype, device=device)
        )  # [slots, n*R, in]
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, out_local, n * max_rank, dtype=dtype, device=device)
        )  # [slots, out, n*R]
        self.scaling = [0.0] * max_loras

    def set_slot(
        self,
        slot: int,
        weights: dict[int, tuple[torch.Tensor, torch.Tensor]],
        scaling: float,
    ) -> None:
        """Put an adapter in `slot`: weights[slice] = (A [r, in_local], B [out_slice, r]);
        slices the adapter does not target stay zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for index, (a, b) in weights.items():
            rank = a.shape[0]
            cols = slice(index * self.max_rank, index * self.max_rank + rank)
            rows = slice(self.slice_offsets[index], self.slice_offsets[index] + b.shape[0])
            self.lora_a[slot, cols].copy_(a)
            self.lora_b[slot, rows, cols].copy_(b)
        self.scaling[slot] = scaling

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scaling[slot] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_local] -> [T, out_local] (all-reduced for a row-parallel layer)."""
        base = self.base
        groups = self.context.groups
        if not groups:
            return base(x)
        bias = base.bias
        if self.row_parallel and tpu.tp_rank() != 0:
            bias = None  # added once, by rank 0 (RowParallelLinear's rule)
        out = base._matmul(x, bias)  # [T, out_local]
        for slot, rows in groups:
            xs = x if rows is None else x.index_select(0, rows)  # [t, in]
            shrunk = xs @ self.lora_a[slot].t()  # [t, n*R]
            delta = (shrunk @ self.lora_b[slot].t()) * self.scaling[slot]  # [t, out]
            if rows is None:
                out += delta
            else:
                out.index_add_(0, rows, delta)
        if self.row_parallel:
            out = tpu.all_reduce(out)
        return out


# Fused layers: the HF modules of their slices, in output order.
_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


def _slices(name: str, module: ParallelLinearBase) -> tuple[tuple[str, ...], list[int]]:
    """(HF module names, local output sizes) of the slices of the layer called `name`."""
    if isinstance(module, QKVParallelLinear):
        return _QKV, [module.q_size, module.kv_size, module.kv_size]
    if isinstance(module, MergedColumnParallelLinear):
        names = _GATE_UP if len(module.output_sizes_local) == 2 else (name,)
        if len(names) != len(module.output_sizes_local):
            names = tuple(f"{name}.{i}" for i in range(len(module.output_sizes_local)))
        return names, list(module.output_sizes_local)
    return (name,), [module.out_features]


def install_lora_layers(
    model: nn.Module,
    context: LoRAContext,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, LoRALinear]:
    """Wrap every tensor-parallel linear layer inside the decoder layers of `model` (not the
    embeddings, lm_head or MoE experts); returns the wrappers by module name (stage-local)."""
    targets = [
        (parent_name, parent, child_name, child)
        for parent_name, parent in model.named_modules()
        for child_name, child in parent.named_children()
        if isinstance(child, ParallelLinearBase) and ".layers." in f".{parent_name}."
    ]
    wrapped: dict[str, LoRALinear] = {}
    for parent_name, parent, child_name, child in targets:
        names, sizes = _slices(child_name, child)
        layer = LoRALinear(child, names, sizes, context, max_loras, max_rank, dtype, device)
        setattr(parent, child_name, layer)
        wrapped[f"{parent_name}.{child_name}"] = layer
    return wrapped
