"""LoRA wrappers around the model's tensor-parallel linear layers, and the step's adapter
mapping they share.

Each wrapped layer holds `max_loras` slots of stacked low-rank weights,
A [slots, n_slices * max_rank, in_local] and B [slots, out_local, n_slices * max_rank]: a fused
layer (q/k/v, gate/up) has one A/B pair per slice, A's rows one block per slice and B block
diagonal (slice i's output rows read only slice i's ranks), so the update of every slice is one
shrink and one expand matmul. An adapter of rank r < max_rank fills the first r rows of its
blocks; the rest stay zero. The update of the rows of one slot is
`((x_rows @ A[slot]^T) @ B[slot]^T) * scaling[slot]`, PEFT's order of operations; the rows are
grouped by slot once per step (`LoRAContext.set_tokens`), so a layer runs a fixed handful of
ops (two batched matmuls over the slots) whatever the number of requests or adapters: on a
busy CPU each op's thread synchronisation costs more than these small matmuls.

Tensor parallelism: column-parallel layers (q/k/v, gate/up, fc1) hold B's rows of this rank's
outputs and the whole A; row-parallel layers (o, down, fc2) hold A's columns of this rank's
inputs and the whole B, and the update is added to the partial output before the all-reduce
(the sum over ranks of x_r A_r^T is x A^T).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)


class LoRAContext:
    """The current step's tokens by adapter slot, shared by the wrapped layers of one stage
    (set once per step, before the stage's forward, so each layer pays only its matmuls).

    One adapter for every token: `single_slot`. Otherwise the tokens of each slot are laid
    out as the rows of a [slots, rows, in] batch (`gather`: each row's token; padding rows
    repeat token 0 and their results are never read), and `inverse` picks each token's update
    back out of the flattened [slots * rows (+1 zero row for the base model's tokens), out]
    result. Every layer then runs the same few ops whatever the number of adapters: a gather,
    two batched matmuls over the slots, the scaling, a gather back and an add (index_add_ on
    CPU is far slower than a gather).
    """

    def __init__(self) -> None:
        self.active = False
        self.single_slot: int | None = None  # every token uses this slot
        self.num_slots = 0  # slots [0, num_slots) in the batched form
        self.rows = 0  # rows per slot (the most tokens one slot has)
        self.gather: torch.Tensor | None = None  # [num_slots * rows]
        self.inverse: torch.Tensor | None = None  # [T]

    def set_tokens(self, token_slots: torch.Tensor) -> None:
        """token_slots [T]: each token's slot, -1 for the base model."""
        self.clear()
        slots = token_slots.tolist()
        used = sorted(set(slots) - {-1})
        if not used:
            return
        self.active = True
        if len(used) == 1 and -1 not in slots:
            self.single_slot = used[0]
            return
        per_slot: list[list[int]] = [[] for _ in range(used[-1] + 1)]
        for token, slot in enumerate(slots):
            if slot >= 0:
                per_slot[slot].append(token)
        self.num_slots = len(per_slot)
        self.rows = max(len(tokens) for tokens in per_slot)
        gather: list[int] = []
        zero_row = self.num_slots * self.rows
        inverse = [zero_row] * len(slots)
        for slot, tokens in enumerate(per_slot):
            for j, token in enumerate(tokens):
                inverse[token] = slot * self.rows + j
            gather += tokens + [0] * (self.rows - len(tokens))
        device = token_slots.device
        self.gather = torch.tensor(gather, dtype=torch.long, device=device)
        self.inverse = torch.tensor(inverse, dtype=torch.long, device=device)

    def clear(self) -> None:
        self.active = False
        self.single_slot = None
        self.num_slots = self.rows = 0
        self.gather = self.inverse = None


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
        self.register_buffer(
            "scale", torch.zeros(max_loras, 1, 1, dtype=dtype, device=device)
        )  # [slots, 1, 1]: scaling[slot], for the batched form

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
        self.scale[slot] = scaling

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scaling[slot] = 0.0
        self.scale[slot] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_local] -> [T, out_local] (all-reduced for a row-parallel layer)."""
        base = self.base
        ctx = self.context
        if not ctx.active:
            return base(x)
        bias = base.bias
        if self.row_parallel and tpu.tp_rank() != 0:
            bias = None  # added once, by rank 0 (RowParallelLinear's rule)
        out = base._matmul(x, bias)  # [T, out_local]
        if ctx.single_slot is not None:
            slot = ctx.single_slot
            shrunk = x @ self.lora_a[slot].t()  # [T, n*R]
            out.addmm_(shrunk, self.lora_b[slot].t(), alpha=self.scaling[slot])
        else:
            assert ctx.gather is not None and ctx.inverse is not None
            slots, rows = ctx.num_slots, ctx.rows
            xs = x.index_select(0, ctx.gather).view(slots, rows, -1)  # [S, rows, in]
            shrunk = torch.bmm(xs, self.lora_a[:slots].transpose(1, 2))  # [S, rows, n*R]
            delta = torch.bmm(shrunk, self.lora_b[:slots].transpose(1, 2))  # [S, rows, out]
            delta.mul_(self.scale[:slots])
            flat = F.pad(delta.view(slots * rows, -1), (0, 0, 0, 1))  # [S*rows + 1, out]
            out += flat.index_select(0, ctx.inverse)  # [T, out]; base tokens add zeros
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
