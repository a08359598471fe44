"""Linear layers: tensor-parallel shards, GGUF blocks, and the CPU path on packed weights.

After loading, `pack_linears` packs every float linear for its CPU kernel (packed_weight.py
chooses the layout: column panels for float32 on AVX2 CPUs, oneDNN's blocked layout
otherwise). `F.linear` in fp32 on CPU goes to a GEMM that repacks the weight on every call;
packed once, the model's matmuls run ~1.5-2.5x faster from 1 row to 2048 (oneDNN on this
project's AVX-512 machine, one thread), and the panels 1.2-1.8x faster than oneDNN again at a
decode step's 1-32 rows on an AVX2 one. bf16 already goes to oneDNN, but still reorders the
weight per call: prepacked, the model's decode matmuls (128 rows) run up to 1.5x faster, and
end to end bf16 throughput (benchmarks/throughput.py, 128 x 64) rose from 464-509 to 531-535
generated tok/s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.packed_weight import PackedWeight, choose_layout, pack
from vllm.model_executor.layers.quantization.gguf import GGUFWeight, make_linear_weight


class PackedLinear(nn.Module):
    """An nn.Linear whose weight is packed for its CPU kernel (packed_weight.py; inference
    only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        packed = pack(linear.weight)
        if packed is None:
            raise ValueError(
                f"PackedLinear: {choose_layout(linear.weight.device, linear.weight.dtype)[1]}"
            )
        self.packed = packed
        self.bias = linear.bias.detach().clone() if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""
        lead = x.shape[:-1]
        out = self.packed(x.reshape(-1, self.in_features), self.bias)
        return out.view(*lead, self.out_features)


def linear_path(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(pack the linears?, a description of the path for the logs and benchmarks): see
    packed_weight.choose_layout. VLLM_CPU_PACKED_LINEAR=0 forces plain matmuls (F.linear)."""
    layout, description = choose_layout(device, dtype)
    return layout is not None, description


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` with a PackedLinear and pack every tensor-parallel
    linear and MoE experts (its shard: weights are sharded first, then packed); returns how
    many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    # MoE experts too: their per-expert matmuls gain as much as the linears.
    parallel = [m for m in model.modules() if isinstance(m, (ParallelLinearBase, FusedMoE))]
    for module in parallel:
        module.pack()
    return len(targets) + len(parallel)


class ParallelLinearBase(nn.Module):
    """A linear layer holding this TP rank's shard: weight [out_local, in_local].

    `pack()` (CPU fp32/bf16) replaces the weight by its packed form (packed_weight.py), like
    PackedLinear; until then it runs F.linear (the fallback path, also used on CUDA). Built
    under `quantization.gguf.quantized_linears(True)`, the weight is GGUF blocks instead
    (`quant`, set after loading).
    """

    # Whether the layer takes GGUF blocks under --quantization gguf (the lm_head: see
    # quantization.gguf.quantize_lm_head).
    QUANTIZABLE = True

    def __init__(self, in_local: int, out_local: int, bias: bool, bias_size: int) -> None:
        super().__init__()
        self.in_features = in_local
        self.out_features = out_local
        if self.QUANTIZABLE:
            self.weight = make_linear_weight(out_local, in_local)
        else:
            self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(bias_size), requires_grad=False) if bias else None
        # The packed weight once pack() ran (None: F.linear on `weight`). Read by the decode
        # fast path (llama_decode.py), which calls it as local_matmul does.
        self.packed: PackedWeight | None = None
        self.quant: GGUFWeight | None = None

    def pack(self) -> None:
        if self.quant is not None:  # GGUF blocks: nothing to pack
            return
        packed = pack(self.weight)
        if packed is None:  # this dtype runs plain matmuls (choose_layout says why)
            return
        self.packed = packed
        del self.weight  # the packed copy replaces it (one copy of the weights in memory)

    def local_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_local] -> [..., out_local] (+ bias)."""
        if self.quant is not None:
            return self.quant(x, bias)
        if self.packed is None:
            return F.linear(x, self.weight, bias)
        lead = x.shape[:-1]
        out = self.packed(x.reshape(-1, self.in_features), bias)
        return out.view(*lead, self.out_features)


class ColumnParallelLinear(ParallelLinearBase):
    """Y = X A^T with A's output rows split over the TP ranks: rank r computes its slice of the
    outputs ([..., out / tp]); no communication (the next row-parallel layer consumes it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        out_local = tpu.divide(out_features, tpu.tp_size(), "output size")
        super().__init__(in_features, out_local, bias, out_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local_matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (LLaMA's gate and up): each is split
    over the ranks, and a rank's shard holds its slice of each one after the other."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = True) -> None:
        self.output_sizes_local = [
            tpu.divide(size, tpu.tp_size(), "intermediate size") for size in output_sizes
        ]
        super().__init__(in_features, sum(output_sizes), bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by attention heads: rank r holds heads_local query heads
    and max(1, kv / tp) KV heads (KV heads replicated over ranks when kv < tp, as vLLM)."""

    def __init__(
        self, hidden: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = True
    ) -> None:
        tp = tpu.tp_size()
        if num_heads % tp != 0:
            raise ValueError(
                f"Total number of attention heads ({num_heads}) must be divisible by tensor "
                f"parallel size ({tp})."
            )
        if (num_kv_heads >= tp and num_kv_heads % tp) or (num_kv_heads < tp and tp % num_kv_heads):
            raise ValueError(
                f"Total number of key/value heads ({num_kv_heads}) and tensor parallel size "
                f"({tp}) must divide one another."
            )
        self.num_heads = num_heads // tp
        self.num_kv_heads = tpu.num_kv_heads_per_rank(num_kv_heads, tp)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        out_local = self.q_size + 2 * self.kv_size
        ParallelLinearBase.__init__(self, hidden, out_local, bias, out_local)


class RowParallelLinear(ParallelLinearBase):
    """Y = X A^T with A's input columns split over the TP ranks: each rank multiplies its slice
    of X ([..., in / tp], a column-parallel layer's output) and the partial sums are all-reduced.
    The bias is added once, by rank 0, inside its matmul (fused, as with TP = 1)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        self.tp_size, self.tp_rank = tpu.tp_size(), tpu.tp_rank()
        in_local = tpu.divide(in_features, self.tp_size, "input size")
        super().__init__(in_local, out_features, bias, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.local_matmul(x, self.bias)
        return tpu.all_reduce(self.local_matmul(x, self.bias if self.tp_rank == 0 else None))
