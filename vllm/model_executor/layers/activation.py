"""Activations: SwiGLU (LLaMA's gated MLP) and a lookup for OPT's activation_function."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x [T, 2*I] holding (gate, up) -> silu(gate) * up, [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


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
