"""Rotary position embedding (LLaMA's rotate-half layout) with a precomputed cos/sin cache."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from vllm import _custom_ops as ops


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key. cos/sin are computed in float32 like HF, then cast."""

    def __init__(
        self,
        head_size: int,
        max_position: int,
        base: float = 10000.0,
        rope_scaling: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
        if rope_type not in (None, "default"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported yet.")
        self.head_size = head_size
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size)
        )
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # [max_position, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, D]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, H*D]; key [T, Hkv*D] -> rotated (same shapes).

        CPU float32/bfloat16 runs the C++ kernel (csrc/elementwise.cpp) when it is built: it
        rotates query and key in place and returns them. In LLaMA they are column slices of the
        qkv projection's fresh output, read by nothing before the rotation, so no copy is
        needed (and none is made: the slices keep their row stride). Otherwise the torch code
        below returns new tensors and leaves its inputs alone.
        """
        if (
            query.dim() == 2
            and key.dim() == 2
            and query.stride(-1) == 1
            and key.stride(-1) == 1
            and ops.supports_rotary_embedding(query, key, self.cos_cache)
        ):
            ops.rotary_embedding(
                positions, query, key, self.head_size, self.cos_cache, self.sin_cache
            )
            return query, key
        num_tokens = positions.shape[0]
        cos = self.cos_cache[positions].to(query.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin_cache[positions].to(query.dtype)[:, None, :]
        q = query.view(num_tokens, -1, self.head_size)
        k = key.view(num_tokens, -1, self.head_size)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q.reshape(query.shape), k.reshape(key.shape)
