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

import os

import torch
from torch import nn

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


def packed_linear_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32/bf16 on CPU with oneDNN available, unless VLLM_CPU_PACKED_LINEAR=0."""
    return (
        device.type == "cpu"
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and os.environ.get("VLLM_CPU_PACKED_LINEAR", "1") != "0"
    )


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` with a PackedLinear; returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
