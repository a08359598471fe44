"""Activations: SwiGLU (LLaMA's gated MLP), GeGLU (Gemma's) and a lookup for OPT's
activation_function."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm import _custom_ops as ops


class SiluAndMul(nn.Module):
    """x [T, 2*I] holding (gate, up) -> silu(gate) * up, [T, I].

    CPU float32 runs the fused C++ kernel (csrc/elementwise.cpp) when it is built;
    like the torch code, it rounds silu(gate) to the dtype before the multiply (as HF does).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 stays on torch: the kernel rounds to bf16 in software, which costs more than
        # torch's native conversion on this project's CPU (0.7x at 128 rows, measured).
        if x.dtype == torch.float32 and ops.supports_elementwise(x):
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """x [T, 2*I] holding (gate, up) -> gelu(gate) * up, [T, I]: Gemma's gated MLP.

    `approximate` is "tanh" for HF's gelu_pytorch_tanh (Gemma 2/3), "none" for the exact gelu.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}.")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation named by a HF config (e.g. OPT's "relu")."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation_function {name!r} is not supported.")
    return _ACTIVATIONS[name]
