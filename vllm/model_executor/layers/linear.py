"""Linear layers with weights prepacked for oneDNN, the CPU fast path (fp32 and bf16).

`F.linear` in fp32 on CPU goes to a GEMM that repacks the weight on every call. With the weight
reordered once into oneDNN's blocked layout and called through oneDNN's linear (dense tensors
in and out, no conversion), the model's matmuls run ~1.5-2.5x faster, from 1 row to 2048
(measured on this project's AVX-512 machine, fp32, one thread). bf16 already goes to oneDNN,
but still reorders the weight per call: prepacked, the model's decode matmuls (128 rows) run up
to 1.5x faster, and end to end bf16 throughput (benchmarks/throughput.py, 128 x 64) rose from
464-509 to 531-535 generated tok/s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm import envs
from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.quantization.gguf import GGUFWeight, make_linear_weight

# dtypes whose linears are prepacked (oneDNN's reorder supports both).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """An nn.Linear whose weight lives in oneDNN's layout (inference only)."""

    # Rows the weight layout is tuned for; any row count works (decode batches are ~this).
    ROWS_HINT = 64

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, self.ROWS_HINT)
        self.bias = linear.bias.detach().clone() if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return out.view(*lead, self.out_features)


# dtype -> None when oneDNN prepacks it on this CPU, else why not (probed once per process).
_PACK_PROBES: dict[torch.dtype, str | None] = {}


def _probe_packing(dtype: torch.dtype) -> str | None:
    """Whether oneDNN can reorder and run a linear of `dtype` on this CPU: None if so, else
    its error. bf16 reorders need avx512bw/vl/dq or avx_ne_convert (an AVX2-only CPU has
    neither, and torch raises at load); asking oneDNN itself covers every CPU torch runs on."""
    if dtype not in _PACK_PROBES:
        try:
            weight = torch.ones(16, 16, dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PackedLinear.ROWS_HINT)
            x = torch.ones(2, 16, dtype=dtype)
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            _PACK_PROBES[dtype] = None
        except RuntimeError as exc:
            _PACK_PROBES[dtype] = str(exc).strip().splitlines()[0]
    return _PACK_PROBES[dtype]


def linear_path(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(prepack the linears?, a description of the path for the logs and benchmarks).

    CPU fp32/bf16 prepack into oneDNN's layout when oneDNN can on this CPU, unless
    VLLM_CPU_PACKED_LINEAR=0; otherwise plain matmuls (F.linear), on every CPU."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return False, f"plain matmul ({device.type}, {dtype})"
    if not torch.backends.mkldnn.is_available():
        return False, "plain matmul (torch built without oneDNN)"
    if not envs.get_bool("VLLM_CPU_PACKED_LINEAR"):
        return False, "plain matmul (VLLM_CPU_PACKED_LINEAR=0)"
    why_not = _probe_packing(dtype)
    if why_not is not None:
        return False, f"plain matmul (oneDNN cannot prepack {dtype} on this CPU: {why_not})"
    capability = torch.backends.cpu.get_cpu_capability()
    return True, f"oneDNN prepacked ({dtype}, CPU capability {capability})"


def packed_linear_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears are prepacked for oneDNN (see `linear_path`)."""
    return linear_path(device, dtype)[0]


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` with a PackedLinear and prepack every tensor-parallel
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

    `pack()` (CPU fp32/bf16) replaces the weight by its oneDNN-prepacked form, like
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
        self._packed: torch.Tensor | None = None
        self.quant: GGUFWeight | None = None

    def pack(self) -> None:
        if self.quant is not None:  # GGUF blocks: nothing to prepack
            return
        weight = self.weight.detach().contiguous()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, PackedLinear.ROWS_HINT)
        del self.weight  # the packed copy replaces it (one copy of the weights in memory)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_local] -> [..., out_local] (+ bias)."""
        if self.quant is not None:
            return self.quant(x, bias)
        if self._packed is None:
            return F.linear(x, self.weight, bias)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, bias, "none", [], "")
        return out.view(*lead, self.out_features)


class ColumnParallelLinear(ParallelLinearBase):
    """Y = X A^T with A's output rows split over the TP ranks: rank r computes its slice of the
    outputs ([..., out / tp]); no communication (the next row-parallel layer consumes it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        out_local = tpu.divide(out_features, tpu.tp_size(), "output size")
        super().__init__(in_features, out_local, bias, out_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


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
            return self._matmul(x, self.bias)
        return tpu.all_reduce(self._matmul(x, self.bias if self.tp_rank == 0 else None))
