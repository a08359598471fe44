"""LoRA wrappers around the model's tensor-parallel linear layers, and the step's adapter
mapping they share.

Each wrapped layer holds `max_loras` slots of stacked low-rank weights,
A [slots, n_slices * max_rank, in_local] and B^T [slots, n_slices * max_rank, out_local]: a
fused layer (q/k/v, gate/up) has one A/B pair per slice, A's rows one block per slice and B
block diagonal (slice i's output columns read only slice i's ranks), so the update of every
slice is one shrink and one expand. An adapter of rank r < max_rank fills the first r rows of
its blocks; the rest stay zero, and `ranks[slot, slice]` records r (0: a slice the adapter does
not target). The update of a token of one slot is `((x @ A[slot]^T) @ B[slot]^T) * scaling`,
PEFT's order of operations.

On the CPU a layer's whole update is one C++ call (csrc/lora.cpp, `_custom_ops.lora_apply`):
the tokens come sorted by slot, an order built once per step (`LoRAContext`) and shared by
every layer, and the kernel does only the arithmetic of the slices and ranks each adapter has.
The pure-torch path (other devices, other dtypes, no built kernels) groups the rows by slot
into a [slots, rows, in] batch and runs two batched matmuls. Measured at batch 16 decode
(SmolLM2, 4 adapters of rank 8) the torch path's half-dozen small ops per layer, not their
arithmetic, were the cost: on a busy CPU each op's dispatch and thread barrier outweigh these
tiny matmuls (see benchmarks/lora.py). A step in which no token uses an adapter runs the base
layers alone.

Tensor parallelism: column-parallel layers (q/k/v, gate/up, fc1) hold B's rows of this rank's
outputs and the whole A; row-parallel layers (o, down, fc2) hold A's columns of this rank's
inputs and the whole B, and the update is added to the partial output before the all-reduce
(the sum over ranks of x_r A_r^T is x A^T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm import _custom_ops as ops
from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)


@dataclass
class _Grouped:
    """The torch path's layout of a step's adapted tokens: each slot's tokens are the rows of
    a [num_slots, rows, in] batch (`gather`: each row's token; padding rows repeat token 0 and
    their results are never read), and `inverse` picks each token's update back out of the
    flattened [num_slots * rows (+1 zero row for the base model's tokens), out] result."""

    num_slots: int  # slots [0, num_slots) in the batched form
    rows: int  # rows per slot (the most tokens one slot has)
    gather: torch.Tensor  # [num_slots * rows]
    inverse: torch.Tensor  # [T]


class LoRAContext:
    """The current step's tokens by adapter slot, shared by the wrapped layers of one stage
    (set once per step, before the stage's forward, so each layer pays only its update).

    `active`: some token uses an adapter. `single_slot`: every token uses that one slot.
    `use_kernel`: the C++ update can run (CPU tokens, kernels built and enabled); its index
    tensors (`sorted_tokens`) and the torch path's (`grouped`) are built on first use in the
    step, by the first layer that needs them.
    """

    def __init__(self) -> None:
        self.active = False
        self.single_slot: int | None = None  # every token uses this slot
        self.use_kernel = False
        self._slots: list[int] = []  # each token's slot, -1 for the base model
        self._device = torch.device("cpu")
        self._sorted: tuple[torch.Tensor, torch.Tensor] | None = None
        self._grouped: _Grouped | None = None

    def set_tokens(self, token_slots: torch.Tensor) -> None:
        """token_slots [T]: each token's slot, -1 for the base model."""
        self.set_slots(token_slots.tolist(), token_slots.device)

    def set_slots(self, slots: list[int], device: torch.device) -> None:
        """Each token's slot (-1: the base model), as a list; the tensors go to `device`."""
        self.clear()
        used = set(slots) - {-1}
        if not used:
            return
        self.active = True
        self._slots = slots
        self._device = device
        self.use_kernel = device.type == "cpu" and ops.is_available()
        if len(used) == 1 and -1 not in slots:
            self.single_slot = slots[0]

    def sorted_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [N], slots [N]) int64: the adapted tokens sorted by slot (stable), and the
        slot of each; the base model's tokens are left out."""
        if self._sorted is None:
            slots = self._slots
            order = sorted((t for t, s in enumerate(slots) if s >= 0), key=slots.__getitem__)
            self._sorted = (
                torch.tensor(order, dtype=torch.long, device=self._device),
                torch.tensor([slots[t] for t in order], dtype=torch.long, device=self._device),
            )
        return self._sorted

    def grouped(self) -> _Grouped:
        """The torch path's [slots, rows] grouping of the adapted tokens (see _Grouped)."""
        if self._grouped is None:
            slots = self._slots
            per_slot: list[list[int]] = [[] for _ in range(max(slots) + 1)]
            for token, slot in enumerate(slots):
                if slot >= 0:
                    per_slot[slot].append(token)
            num_slots = len(per_slot)
            rows = max(len(tokens) for tokens in per_slot)
            gather: list[int] = []
            inverse = [num_slots * rows] * len(slots)  # the zero row
            for slot, tokens in enumerate(per_slot):
                for j, token in enumerate(tokens):
                    inverse[token] = slot * rows + j
                gather += tokens + [0] * (rows - len(tokens))
            device = self._device
            self._grouped = _Grouped(
                num_slots,
                rows,
                torch.tensor(gather, dtype=torch.long, device=device),
                torch.tensor(inverse, dtype=torch.long, device=device),
            )
        return self._grouped

    def clear(self) -> None:
        self.active = False
        self.single_slot = None
        self.use_kernel = False
        self._slots = []
        self._sorted = None
        self._grouped = None


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
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.base = base
        self.slice_names = slice_names
        # Output column boundaries of the slices: slice i is [bounds[i], bounds[i + 1]).
        self.slice_bounds = [sum(slice_sizes[:i]) for i in range(len(slice_sizes) + 1)]
        self.slice_offsets = self.slice_bounds[:-1]
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
        # B transposed: a rank's output columns are contiguous, as the expand reads them.
        self.register_buffer(
            "lora_b_t", torch.zeros(max_loras, n * max_rank, out_local, dtype=dtype, device=device)
        )  # [slots, n*R, out]
        self.scaling = [0.0] * max_loras
        # float32 whatever the dtype: PEFT multiplies by a Python float (computed in fp32).
        self.register_buffer(
            "scale", torch.zeros(max_loras, dtype=torch.float32, device=device)
        )  # [slots]
        self.register_buffer(
            "ranks", torch.zeros(max_loras, n, dtype=torch.long, device=device)
        )  # [slots, n]: the adapter's rank on each slice, 0 if it does not target it
        self.kernel_dtype = torch.device(device).type == "cpu" and dtype in ops.LORA_DTYPES

    def set_slot(
        self,
        slot: int,
        weights: dict[int, tuple[torch.Tensor, torch.Tensor]],
        scaling: float,
    ) -> None:
        """Put an adapter in `slot`: weights[slice] = (A [r, in_local], B [out_slice, r]);
        slices the adapter does not target stay zero. A checkpoint's own fused module (Phi-3's
        qkv_proj, gate_up_proj) comes as slice 0 with B's rows over all the slices: each slice
        gets the same A and its own rows of B (every output column's sum is unchanged)."""
        self.clear_slot(slot)
        for index, (a, b) in weights.items():
            rank = a.shape[0]
            if b.shape[0] > self.slice_bounds[-1] - self.slice_offsets[index]:
                raise ValueError(
                    f"LoRA B of {self.slice_names[index]} has {b.shape[0]} rows, more than "
                    f"the {self.slice_bounds[-1] - self.slice_offsets[index]} outputs from "
                    "that slice on"
                )
            row, i = 0, index
            while row < b.shape[0]:
                size = min(self.slice_sizes[i], b.shape[0] - row)
                cols = slice(i * self.max_rank, i * self.max_rank + rank)
                outs = slice(self.slice_offsets[i], self.slice_offsets[i] + size)
                self.lora_a[slot, cols].copy_(a)
                self.lora_b_t[slot, cols, outs].copy_(b[row : row + size].t())
                self.ranks[slot, i] = rank
                row, i = row + size, i + 1
        self.scaling[slot] = scaling
        self.scale[slot] = scaling

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b_t[slot].zero_()
        self.ranks[slot].zero_()
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
        out = base.local_matmul(x, bias)  # [T, out_local]
        if (
            ctx.use_kernel
            and self.kernel_dtype
            and x.dim() == 2
            and x.stride(-1) == 1
            and out.stride(-1) == 1
        ):
            tokens, slots = ctx.sorted_tokens()  # [N], [N]
            ops.lora_apply(
                out,
                x,
                self.lora_a,
                self.lora_b_t,
                tokens,
                slots,
                self.scale,
                self.ranks,
                self.slice_bounds,
            )
        elif ctx.single_slot is not None:
            slot = ctx.single_slot
            shrunk = x @ self.lora_a[slot].t()  # [T, n*R]
            out.addmm_(shrunk, self.lora_b_t[slot], alpha=self.scaling[slot])
        else:
            self._grouped_update(out, x, ctx.grouped())
        if self.row_parallel:
            out = tpu.all_reduce(out)
        return out

    def _grouped_update(self, out: torch.Tensor, x: torch.Tensor, g: _Grouped) -> None:
        """The torch path for tokens of several slots: out [T, out] += each token's update."""
        slots, rows = g.num_slots, g.rows
        xs = x.index_select(0, g.gather).view(slots, rows, -1)  # [S, rows, in]
        shrunk = torch.bmm(xs, self.lora_a[:slots].transpose(1, 2))  # [S, rows, n*R]
        delta = torch.bmm(shrunk, self.lora_b_t[:slots])  # [S, rows, out]
        delta.mul_(self.scale[:slots].view(slots, 1, 1))
        flat = F.pad(delta.view(slots * rows, -1), (0, 0, 0, 1))  # [S*rows + 1, out]
        out += flat.index_select(0, g.inverse)  # [T, out]; base tokens add zeros


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
