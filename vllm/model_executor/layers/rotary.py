"""Rotary position embedding (rotate-half layout) with precomputed cos/sin caches, for every
rope variant HF configs name: default, linear, dynamic (NTK), yarn, longrope (Phi-3) and
llama3, each with transformers' formulas (`modeling_rope_utils.py`), and partial rotary.

Variants that only change the frequencies (linear, llama3, yarn) or scale cos/sin (yarn's and
longrope's attention factor) only change the caches, so they keep the C++ kernel's fast path.

Two depend on the sequence length, as in HF, where a forward call over a sequence of `s`
tokens picks its frequencies from `s`: longrope uses its long factors once `s` exceeds the
original context length, dynamic NTK grows its base once `s` exceeds
`max_position_embeddings`. HF's generate runs the prompt in one call, then one call per token,
so a token at position `p` of a sequence of `n` tokens at its prefill gets `s = max(p + 1, n)`
(`token_seq_lens`), whatever the chunking of the prompt here. Longrope equals HF for a
sequence that is longer than the original context from its prefill (all long) or never gets
there (all short). One that crosses it while generating does not: at the crossing HF drops its
KV cache and recomputes the whole sequence with the long factors (Phi-3's
`prepare_inputs_for_generation`); here the tokens before the crossing keep their short-factor
keys. (vLLM instead picks one set for every sequence: long when max_model_len exceeds the
original context.)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm.transformers_utils.rope_config import (
    check_rope_type,
    get_rope_parameters,
    max_positions_served,
    rope_type_of,
    scaled_max_positions,
)

# The engine's max_model_len while a stage's model is built (`serving_positions`): a context
# longer than the config's, allowed by VLLM_ALLOW_LONG_MAX_MODEL_LEN, still gets a cos/sin row
# for every position it can reach.
_SERVED_POSITIONS: contextvars.ContextVar[int] = contextvars.ContextVar(
    "rope_served_positions", default=0
)


@contextlib.contextmanager
def serving_positions(max_model_len: int) -> Iterator[None]:
    """Ropes built inside cover at least `max_model_len` positions."""
    token = _SERVED_POSITIONS.set(max_model_len)
    try:
        yield
    finally:
        _SERVED_POSITIONS.reset(token)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _default_inv_freq(base: float | torch.Tensor, dim: int) -> torch.Tensor:
    """[dim/2] float32: 1 / base^(2i/dim)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_inv_freq(
    params: dict[str, Any], dim: int, base: float, max_position: int
) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_position / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the original frequency (high-frequency dims), 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _llama3_inv_freq(params: dict[str, Any], dim: int, base: float) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim)
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_attention_factor(params: dict[str, Any], max_position: int) -> float:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return float(attention_factor)


def compute_inv_freq(
    params: dict[str, Any],
    dim: int,
    max_position: int,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention factor) of a rope parameter dict (as returned by
    `get_rope_parameters`) for the rotary width `dim`, as transformers computes them for a
    forward call over a sequence of `seq_len` tokens (None: at initialisation)."""
    rope_type = rope_type_of(params)
    check_rope_type(rope_type)
    base = params["rope_theta"]
    if rope_type == "default":
        return _default_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(base, dim) / params["factor"], 1.0
    if rope_type == "dynamic":
        factor = params["factor"]
        if seq_len is None:  # HF's initial frequencies: python floats throughout
            grown = base * ((factor * max_position / max_position) - (factor - 1)) ** (
                dim / (dim - 2)
            )
            return _default_inv_freq(grown, dim), 1.0
        # HF's growth path gets seq_len as an int64 tensor: the new base is float32.
        s = torch.maximum(torch.tensor(seq_len), torch.tensor(max_position))
        grown_t = base * ((factor * s / max_position) - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(grown_t, dim), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, dim, base, max_position)
    if rope_type == "longrope":
        original = params["original_max_position_embeddings"]
        use_long = seq_len is not None and seq_len > original
        ext = torch.tensor(
            params["long_factor" if use_long else "short_factor"], dtype=torch.float32
        )
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (ext * base**shape), _longrope_attention_factor(params, max_position)
    return _llama3_inv_freq(params, dim, base), 1.0


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """positions [N] (float32) x inv_freq [D/2] -> (cos, sin) stacked: [2, N, D], float32,
    times the attention factor (HF multiplies after cos/sin, in float32)."""
    freqs = torch.outer(positions, inv_freq)  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.stack((cos, sin))


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key. cos/sin are computed in float32 like HF, then cast.

    `max_position` is the config's `max_position_embeddings` (the reference of dynamic NTK and
    of longrope's default factor); the caches cover `cache_positions` positions (default
    `max_position`; `get_rope` passes the length the scaling serves, as the engine's
    max_model_len, `rope_config.max_positions_served`), and at least the engine's max_model_len
    when the model is built inside `serving_positions`. `rope_scaling` is the config's rope dict
    (`rope_parameters` or the older `rope_scaling`; `rope_theta` inside it wins over `base`).
    `rotary_dim` < head_size rotates only the first dims of each head (partial rotary; default
    head_size x the dict's `partial_rotary_factor`).
    """

    def __init__(
        self,
        head_size: int,
        max_position: int,
        base: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
        cache_positions: int | None = None,
    ) -> None:
        super().__init__()
        params = dict(rope_scaling or {})
        params["rope_type"] = rope_type_of(params)
        params.pop("type", None)
        check_rope_type(params["rope_type"])
        if params.get("rope_theta") is None:
            params["rope_theta"] = base
        if params["rope_type"] in ("llama3", "yarn", "longrope"):
            params.setdefault("original_max_position_embeddings", max_position)
        self.params = params
        self.rope_type: str = params["rope_type"]
        self.head_size = head_size
        if rotary_dim is None:
            rotary_dim = int(head_size * (params.get("partial_rotary_factor") or 1.0))
        if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
            raise ValueError(
                f"rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}."
            )
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        n = max(cache_positions or max_position, _SERVED_POSITIONS.get())
        self.cache_positions = n
        positions = torch.arange(n, dtype=torch.int64).float()
        inv_freq, scale = compute_inv_freq(params, rotary_dim, max_position)
        cos_sin = _cos_sin(positions, inv_freq, scale)  # [2, n, rotary_dim]
        # Positions from which the sequence length changes the frequencies (None: never).
        self.switch_len: int | None = None
        if self.rope_type == "longrope":
            # Rows [n, 2n): the long factors, selected by an index offset of n.
            self.switch_len = params["original_max_position_embeddings"]
            original = self.switch_len
            long_inv, _ = compute_inv_freq(params, rotary_dim, max_position, original + 1)
            cos_sin = torch.cat((cos_sin, _cos_sin(positions, long_inv, scale)), dim=1)
        elif self.rope_type == "dynamic":
            self.switch_len = max_position
        self.register_buffer("cos_cache", cos_sin[0].contiguous(), persistent=False)
        self.register_buffer("sin_cache", cos_sin[1].contiguous(), persistent=False)

    @property
    def depends_on_seq_len(self) -> bool:
        """Whether `forward` needs each token's sequence length (`token_seq_lens`)."""
        return self.switch_len is not None

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, H*D]; key [T, Hkv*D] -> rotated (same shapes). seq_lens [T]
        (longrope, dynamic): the sequence length `s` each token's frequencies come from
        (default: position + 1, a decode step's).

        CPU float32/bfloat16 with full rotary runs the C++ kernel (csrc/elementwise.cpp) when it
        is built: it rotates query and key in place and returns them. In the models they are
        column slices of the qkv projection's fresh output (or the q/k norms' outputs), read by
        nothing before the rotation, so no copy is needed. Otherwise the torch code below
        returns new tensors and leaves its inputs alone.
        """
        index = positions
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.switch_len is not None:
            s = positions + 1 if seq_lens is None else seq_lens
            if self.rope_type == "longrope":
                index = positions + (s > self.switch_len).to(positions.dtype) * self.cache_positions
            elif bool((s > self.switch_len).any()):
                cos_sin = self._dynamic_cos_sin(positions, s)
        if (
            cos_sin is None
            and self.rotary_dim == self.head_size
            and query.dim() == 2
            and key.dim() == 2
            and query.stride(-1) == 1
            and key.stride(-1) == 1
            and ops.supports_rotary_embedding(query, key, self.cos_cache)
        ):
            ops.rotary_embedding(index, query, key, self.head_size, self.cos_cache, self.sin_cache)
            return query, key
        if cos_sin is None:
            cos_sin = (self.cos_cache[index], self.sin_cache[index])
        cos = cos_sin[0].to(query.dtype)[:, None, :]  # [T, 1, rotary_dim]
        sin = cos_sin[1].to(query.dtype)[:, None, :]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H*D] -> rotated copy; only the first rotary_dim dims of each head turn."""
        heads = x.reshape(x.shape[0], -1, self.head_size)  # [T, H, D]
        if self.rotary_dim == self.head_size:
            out = heads * cos + _rotate_half(heads) * sin
        else:
            rot, rest = heads[..., : self.rotary_dim], heads[..., self.rotary_dim :]
            out = torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
        return out.reshape(x.shape)

    def _dynamic_cos_sin(
        self, positions: torch.Tensor, seq_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic NTK past max_position_embeddings: each token's cos/sin from the base its
        sequence length gives (HF recomputes the frequencies per forward call)."""
        cos = self.cos_cache[positions].clone()  # [T, rotary_dim]
        sin = self.sin_cache[positions].clone()
        for s in torch.unique(seq_lens[seq_lens > self.max_position]).tolist():
            rows = (seq_lens == s).nonzero().squeeze(1)
            inv_freq, scale = compute_inv_freq(self.params, self.rotary_dim, self.max_position, s)
            grown = _cos_sin(positions[rows].float(), inv_freq, scale)
            cos[rows], sin[rows] = grown[0], grown[1]
        return cos, sin


def token_seq_lens(positions: torch.Tensor, md: Any) -> torch.Tensor:
    """[T] int64: the sequence length HF's generate would have used for each token's rope,
    `max(position + 1, n)` with `n` the tokens of a prefill's sequence (see the module
    docstring). `md` is the step's InputMetadata: prefill tokens first, then one per decode."""
    s = positions + 1
    if md.num_prefills:
        total = getattr(md, "prefill_total_lens", None)
        if total is None:  # what this step holds of each sequence
            total = md.prefill_context_lens + md.prefill_seq_lens
        counts = md.prefill_seq_lens.to(s.device)
        per_token = torch.repeat_interleave(total.to(s.device), counts)
        n = md.num_prefill_tokens
        s[:n] = torch.maximum(s[:n], per_token)
    return s


def get_rope(
    config: Any,
    head_size: int,
    rope_parameters: dict[str, Any] | None = None,
    max_position: int | None = None,
) -> RotaryEmbedding:
    """The RotaryEmbedding a model config asks for: its rope type, theta, partial rotary
    factor and context lengths. A model builds one and shares it between its layers (the
    caches of a long-context model are large).

    `rope_parameters` overrides the config's rope dict (e.g. one layer type's)."""
    params = get_rope_parameters(config, rope_parameters)
    served = max_positions_served(config, rope_parameters)
    if max_position is not None:  # an explicit reference length (tests, per-layer ropes)
        served = scaled_max_positions(params, max_position)
    max_position = max_position or config.max_position_embeddings
    return RotaryEmbedding(
        head_size, max_position, params["rope_theta"], params, cache_positions=served
    )
