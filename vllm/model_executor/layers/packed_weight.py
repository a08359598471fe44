"""A dense CPU weight in the layout its matmul kernel reads: the one owner of that choice.

Two layouts, picked per weight dtype when a model's linears are packed after loading:
- "panels" (float32): column panels [ceil(out / 16), in, 16] for the C++ kernel
  `linear_panels` (csrc/linear_panels.cpp). It prefetches the next panel while multiplying
  the current one, so a decode step's weights stream from memory under the arithmetic: over
  SmolLM2-135M's 538 MB of fp32 weights, one thread of an AVX2 EPYC, 1.29x oneDNN at 1 row,
  1.76x at 4, 1.22x at 16, 1.31x at 32, 1.12x at 128 and 1.04x at 512 (docs/PERFORMANCE.md,
  "Panel matmuls"). The kernel has no AVX-512 variant, so by default it is used only where
  the C++ kernels run AVX2 (`_custom_ops.cpu_isa()`).
- "onednn" (float32, bfloat16): oneDNN's blocked layout (`_reorder_linear_weight`), called
  through oneDNN's linear; the default on AVX-512 CPUs and for bf16.

`VLLM_CPU_LINEAR_LAYOUT` overrides the automatic choice ("panels" or "onednn"; panels apply
to float32 only) and `VLLM_CPU_PACKED_LINEAR=0` turns packing off (plain `F.linear`).
"""

from __future__ import annotations

import torch

from vllm import _custom_ops as ops
from vllm import envs

# dtypes whose linears are packed (oneDNN's reorder supports both; panels are float32).
PACKED_DTYPES = (torch.float32, torch.bfloat16)
LAYOUTS = ("panels", "onednn")
# Output columns per panel (csrc/linear_panels.cpp's kPanel).
PANEL = 16
# Rows oneDNN's layout is tuned for; any row count works (decode batches are about this).
ONEDNN_ROWS_HINT = 64

# dtype -> None when oneDNN prepacks it on this CPU, else why not (probed once per process).
_PACK_PROBES: dict[torch.dtype, str | None] = {}


def _probe_onednn(dtype: torch.dtype) -> str | None:
    """Whether oneDNN can reorder and run a linear of `dtype` on this CPU: None if so, else
    its error. bf16 reorders need avx512bw/vl/dq or avx_ne_convert (an AVX2-only CPU has
    neither, and torch raises at load); asking oneDNN itself covers every CPU torch runs on."""
    if dtype not in _PACK_PROBES:
        try:
            weight = torch.ones(16, 16, dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT)
            x = torch.ones(2, 16, dtype=dtype)
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            _PACK_PROBES[dtype] = None
        except RuntimeError as exc:
            _PACK_PROBES[dtype] = str(exc).strip().splitlines()[0]
    return _PACK_PROBES[dtype]


def _requested_layout() -> str:
    layout = envs.get_str("VLLM_CPU_LINEAR_LAYOUT")
    if layout not in ("auto", *LAYOUTS):
        raise ValueError(
            f"VLLM_CPU_LINEAR_LAYOUT must be 'auto', 'panels' or 'onednn', got {layout!r}."
        )
    return layout


def choose_layout(device: torch.device, dtype: torch.dtype) -> tuple[str | None, str]:
    """(the layout a linear of `dtype` on `device` is packed in, None for plain matmuls; a
    description of the path for the logs and benchmarks)."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return None, f"plain matmul ({device.type}, {dtype})"
    if not envs.get_bool("VLLM_CPU_PACKED_LINEAR"):
        return None, "plain matmul (VLLM_CPU_PACKED_LINEAR=0)"
    requested = _requested_layout()
    panels_ok = dtype == torch.float32 and ops.is_available()
    if panels_ok and (requested == "panels" or (requested == "auto" and ops.cpu_isa() == "avx2")):
        return "panels", f"panel matmuls ({dtype}, {ops.cpu_isa()} kernel)"
    if not torch.backends.mkldnn.is_available():
        return None, "plain matmul (torch built without oneDNN)"
    why_not = _probe_onednn(dtype)
    if why_not is not None:
        return None, f"plain matmul (oneDNN cannot prepack {dtype} on this CPU: {why_not})"
    capability = torch.backends.cpu.get_cpu_capability()
    return "onednn", f"oneDNN prepacked ({dtype}, CPU capability {capability})"


class PackedWeight:
    """A weight [out, in] in `layout`, and the matmul that reads it: x [n, in] -> [n, out]."""

    def __init__(self, weight: torch.Tensor, layout: str) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"PackedWeight: unknown layout {layout!r} (one of {LAYOUTS})")
        if layout == "panels" and weight.dtype != torch.float32:
            raise TypeError(f"PackedWeight: panels hold float32 weights, not {weight.dtype}")
        self.layout = layout
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        weight = weight.detach().contiguous()
        if layout == "panels":
            n_panels = -(-self.out_features // PANEL)
            padded = weight.new_zeros(n_panels * PANEL, self.in_features)
            padded[: self.out_features] = weight
            # [P, in, 16]: panel p's line k holds W[16p .. 16p + 15, k].
            self.data = padded.view(n_panels, PANEL, self.in_features).transpose(1, 2).contiguous()
        else:
            self.data = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, in] -> [n, out] (+ bias [out])."""
        x = x.contiguous()
        if self.layout == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        torch.ops.vllm_pp.linear_panels(out, x, self.data, bias)
        return out


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """`weight` packed in the layout chosen for its dtype on this CPU (choose_layout), or None
    when linears of that dtype run as plain matmuls."""
    layout, _ = choose_layout(weight.device, weight.dtype)
    return PackedWeight(weight, layout) if layout is not None else None
