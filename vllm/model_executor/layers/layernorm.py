"""RMSNorm as LLaMA uses it (statistics in float32, weight applied in the model dtype), and
Gemma's variant (weight applied as 1 + w, all in float32)."""

from __future__ import annotations

import torch
from torch import nn

from vllm import _custom_ops as ops


class RMSNorm(nn.Module):
    """Root-mean-square layer norm; matches HF LlamaRMSNorm's order of casts exactly.

    With a `residual`, the residual add in front of the norm is fused into it (as in vLLM):
    `forward(x, residual)` returns `(norm(residual + x), residual + x)`. CPU float32/bfloat16
    runs the C++ kernels of csrc/elementwise.cpp when they are built, else the torch code below.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> normed [T, hidden]; or, with residual [T, hidden], the pair
        (normed sum, sum) of the residual stream's sum = residual + x.

        With a residual the kernel works in place: x receives the normed output and residual
        the sum, and both are returned. Pass only activations this forward owns.
        """
        if residual is None:
            if ops.supports_elementwise(x, self.weight):
                return ops.rms_norm(x, self.weight, self.variance_epsilon)
            return self._norm(x)
        if (
            ops.supports_elementwise(x, residual, self.weight)
            and x.dim() == 2
            and x.shape == residual.shape
            and x.stride(-1) == 1
            and residual.stride(-1) == 1
        ):
            ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
            return x, residual
        # The decoder layer's `h = residual + h` (one dtype add), then the norm of the sum.
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path, HF LlamaRMSNorm verbatim."""
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(input_dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied as (1 + w), and
    everything is computed in float32 with one cast at the end (HF Gemma2RMSNorm /
    Gemma3RMSNorm). Same calling convention as RMSNorm, including the fused residual add.

    float32 runs the C++ kernels with the weight (1 + w): the kernel's casts are then HF's. In
    bfloat16 HF multiplies by (1 + w) before rounding, which the kernels (LLaMA's order) do not,
    so bfloat16 takes the torch code.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> normed; with residual [T, hidden], (normed sum, sum) as RMSNorm.
        With a residual the kernel works in place, as in RMSNorm."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            scale = 1.0 + self.weight  # [hidden]: HF's `1.0 + weight.float()`
            if residual is None:
                if ops.supports_elementwise(x, scale):
                    return ops.rms_norm(x, scale, self.variance_epsilon)
            elif (
                ops.supports_elementwise(x, residual, scale)
                and x.dim() == 2
                and x.shape == residual.shape
                and x.stride(-1) == 1
                and residual.stride(-1) == 1
            ):
                ops.fused_add_rms_norm(x, residual, scale, self.variance_epsilon)
                return x, residual
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path, HF Gemma2RMSNorm verbatim."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).type_as(x)
