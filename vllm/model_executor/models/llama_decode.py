"""The decode fast path of the LLaMA-style decoder layer: a step of decodes only, with few
tokens (batch-1 decode above all), runs each layer as one straight sequence of the C++ kernel
calls the modules would make, without the nn.Module call chain and the per-call `supports_*`
checks (~30 module calls and ~10 checks per layer: most of a batch-1 decode step outside the
matmuls, docs/PERFORMANCE.md).

`decode_plans` is the one place that decides: it checks once per step what depends on the step
(decodes only, the token count against every matmul's limit, dtypes, kernels available) and
returns each layer's `LayerPlan` (built once per layer from what depends only on the layer:
LLaMA's plain layer, kernel-ready weights), or None for the general path. A plan calls the same
kernels with the same arguments as the general path, so results are bit-identical. A layer
whose four matmuls are GGUF blocks makes those calls from C++ in one op
(`torch.ops.vllm_pp.decode_layer_gguf`, csrc/decode_layer.cpp) when the built extension has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.layers.attention import KVCache
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)

Matmul = Callable[[torch.Tensor], torch.Tensor]

# The activation dtype of the fast path: every kernel it calls takes float32 (bfloat16's SwiGLU
# stays on torch, activation.py), as do the GGUF and dense decode steps measured.
DTYPE = torch.float32
# Packed dense matmuls have no token limit of their own; the fast path is for small steps.
DENSE_MAX_TOKENS = 32
_LINEAR_TYPES = (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
# Whether a plan with GGUF blocks runs as the one C++ op (the same kernels, so the same bits);
# tests switch it off to compare against the kernel-by-kernel sequence.
USE_LAYER_OP = True


def _decode_matmul(linear: nn.Module) -> tuple[Matmul, int] | None:
    """(x [T, K] -> [T, N], the token count T must stay below) calling what the layer's
    forward calls for a 2-D float32 x with a unit last stride; None when it is not one of
    these (a LoRA wrapper, a TP-split row-parallel layer, GGUF parts, an unpacked weight)."""
    if type(linear) not in _LINEAR_TYPES or getattr(linear, "tp_size", 1) != 1:
        return None
    assert isinstance(linear, ParallelLinearBase)
    if linear.quant is not None:
        if linear.bias is not None or linear.quant.dtype != DTYPE:
            return None
        return linear.quant.decode_matmul()
    packed, bias = linear.packed, linear.bias
    if packed is None or packed.dtype != DTYPE:
        return None

    def matmul(x: torch.Tensor) -> torch.Tensor:
        # ParallelLinearBase.local_matmul's call for a 2-D contiguous x.
        return packed(x, bias)

    return matmul, DENSE_MAX_TOKENS


def _decode_blocks(linear: nn.Module) -> tuple[torch.Tensor, int, bool] | None:
    """(blocks, ggml type, int8 kernel) of a linear `_decode_matmul` calls GGUF's block
    kernel for, else None."""
    quant = getattr(linear, "quant", None)
    if type(linear) not in _LINEAR_TYPES or quant is None or _decode_matmul(linear) is None:
        return None
    return quant.decode_blocks()


def _norm_ok(norm: nn.Module) -> bool:
    return type(norm) is RMSNorm and norm.weight.dtype == DTYPE and norm.weight.is_cpu


class LayerPlan:
    """One LLaMA decoder layer's decode step as direct kernel calls (`run`)."""

    def __init__(self, layer: nn.Module, matmuls: list[tuple[Matmul, int]]) -> None:
        attn = layer.self_attn
        linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        blocks = [_decode_blocks(linear) for linear in linears]
        # The one-op layer's weights (qkv, o, gate_up, down), ggml types and int8 flags, when
        # all four are GGUF blocks and the extension has the op.
        self.blocks: tuple[list[torch.Tensor], list[int], list[int]] | None = None
        if _decode_layer is not None and all(b is not None for b in blocks):
            self.blocks = (
                [b[0] for b in blocks if b is not None],
                [b[1] for b in blocks if b is not None],
                [int(b[2]) for b in blocks if b is not None],
            )
        (self.qkv, _), (self.o, _), (self.gate_up, _), (self.down, _) = matmuls
        self.max_tokens = min(limit for _, limit in matmuls)
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
        )
        rope = attn.rotary_emb
        self.cos, self.sin = rope.cos_cache, rope.sin_cache
        self.in_norm = layer.input_layernorm.weight
        self.in_eps = layer.input_layernorm.variance_epsilon
        self.post_norm = layer.post_attention_layernorm.weight
        self.post_eps = layer.post_attention_layernorm.variance_epsilon
        paged = attn.attn
        self.scale = float(paged.scale)
        # The attention kernel's "none" for both options is 0 (ops.paged_attention_decode).
        self.window = int(paged.sliding_window or 0)
        self.soft_cap = float(paged.logits_soft_cap or 0.0)

    @classmethod
    def build(cls, layer: nn.Module) -> LayerPlan | None:
        """The plan of `layer`, or None when it is not LLaMA's plain layer on kernel-ready
        float32 weights (q/k norms, a partial or sequence-length dependent rope, an MoE block,
        LoRA, TP, or matmuls without a direct call take the general path)."""
        is_plain = getattr(layer, "is_plain", None)
        if is_plain is None or not is_plain():
            return None
        attn = layer.self_attn
        rope = attn.rotary_emb
        if (
            attn.qk_norm
            or rope.rotary_dim != rope.head_size
            or rope.depends_on_seq_len
            or rope.cos_cache.dtype != torch.float32
            or not rope.cos_cache.is_cpu
            or not _norm_ok(layer.input_layernorm)
            or not _norm_ok(layer.post_attention_layernorm)
        ):
            return None
        linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        matmuls = [_decode_matmul(linear) for linear in linears]
        if any(m is None for m in matmuls):
            return None
        return cls(layer, [m for m in matmuls if m is not None])

    def run(
        self,
        step: DecodeStep,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaDecoderLayer.forward for a decode step: hidden [T, hidden] (and residual, as
        there; both may be overwritten in place) -> (MLP output [T, hidden], residual)."""
        if self.blocks is not None and USE_LAYER_OP:
            return self._run_op(step, hidden, residual, kv_cache)
        if residual is None:
            residual = hidden
            h = ops.rms_norm(hidden, self.in_norm, self.in_eps)
        else:
            _fused_add_rms_norm(hidden, residual, self.in_norm, self.in_eps)
            h = hidden
        qkv = self.qkv(h)  # [T, q + 2kv]
        t, q_end = qkv.shape[0], self.q_size
        k_end = q_end + self.kv_size
        q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]  # views, unit stride
        # In place, as RotaryEmbedding.forward's kernel call.
        _rotary(step.positions, q, k, self.head_dim, self.cos, self.sin)
        k3 = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v3 = v.view(t, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        _write_kv(k3, v3, key_cache, value_cache, step.slot_mapping)
        q3 = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        attn = torch.empty(q3.shape, dtype=q3.dtype)  # the kernel's output, [T, H, D]
        _attention(
            attn,
            q3,
            key_cache,
            value_cache,
            step.block_tables,
            step.context_lens,
            self.scale,
            self.window,
            self.soft_cap,
        )
        o = self.o(attn.view(t, self.num_heads * self.head_dim))  # [T, hidden]
        _fused_add_rms_norm(o, residual, self.post_norm, self.post_eps)
        gate_up = self.gate_up(o)  # [T, 2I]
        act = torch.empty(t, gate_up.shape[1] // 2, dtype=gate_up.dtype)  # [T, I]
        _silu_and_mul(act, gate_up)
        return self.down(act), residual

    def _run_op(
        self,
        step: DecodeStep,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`run` as one C++ op: the same kernel calls, made from decode_layer.cpp."""
        assert self.blocks is not None and _decode_layer is not None
        (qkv, o, gate_up, down), qtypes, int8 = self.blocks
        first = residual is None
        # The first layer's residual is its input: decode_layer_gguf then reads only hidden.
        stream = hidden if residual is None else residual
        key_cache, value_cache = kv_cache
        out = _decode_layer(
            hidden,
            stream,
            first,
            self.in_norm,
            self.in_eps,
            self.post_norm,
            self.post_eps,
            qkv,
            o,
            gate_up,
            down,
            qtypes,
            int8,
            step.positions,
            self.cos,
            self.sin,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            key_cache,
            value_cache,
            step.slot_mapping,
            step.block_tables,
            step.context_lens,
            self.scale,
            self.window,
            self.soft_cap,
        )  # [T, hidden]
        return out, stream


def _modules_of(layer: nn.Module) -> tuple[nn.Module | None, ...]:
    """(attention, MLP, qkv, o, gate/up, down) of a LLaMA layer, read from the module dicts
    (nn.Module's attribute lookup of a submodule is a Python call: this runs per layer and
    step)."""
    attn, mlp = layer._modules.get("self_attn"), layer._modules.get("mlp")
    if attn is None or mlp is None:
        return (attn, mlp)
    attn_m, mlp_m = attn._modules, mlp._modules
    return (
        attn,
        mlp,
        attn_m.get("qkv_proj"),
        attn_m.get("o_proj"),
        mlp_m.get("gate_up_proj"),
        mlp_m.get("down_proj"),
    )


class DecodeStep:
    """What every layer of a decode step reads, converted once per step: positions [T], slot
    mapping [T], block tables [T, max_blocks] and context lengths [T], int64 contiguous."""

    __slots__ = ("positions", "slot_mapping", "block_tables", "context_lens")

    def __init__(self, positions: torch.Tensor, md: InputMetadata) -> None:
        self.positions = ops.as_int64(positions)
        self.slot_mapping = ops.as_int64(md.slot_mapping)
        self.block_tables = ops.as_int64(md.decode_block_tables)
        self.context_lens = ops.as_int64(md.decode_context_lens)


# The kernels' bound overloads (what the _custom_ops wrappers call), looked up at first use:
# the extension may be absent, then no plan runs.
_fused_add_rms_norm: Callable[..., None]
_rotary: Callable[..., None]
_write_kv: Callable[..., None]
_attention: Callable[..., None]
_silu_and_mul: Callable[..., None]
# The one-op layer (csrc/decode_layer.cpp); None when the built extension predates it.
_decode_layer: Callable[..., torch.Tensor] | None = None


def _bind_kernels() -> None:
    global _fused_add_rms_norm, _rotary, _write_kv, _attention, _silu_and_mul, _decode_layer
    kernels = torch.ops.vllm_pp
    _decode_layer = (
        kernels.decode_layer_gguf.default if hasattr(kernels, "decode_layer_gguf") else None
    )
    _fused_add_rms_norm = kernels.fused_add_rms_norm.default
    _rotary = kernels.rotary_embedding.default
    _write_kv = kernels.write_to_kv_cache.default
    _attention = kernels.paged_attention_decode.default
    _silu_and_mul = kernels.silu_and_mul.default


_bound = False


def _plan_of(layer: nn.Module) -> LayerPlan | None:
    """The layer's plan (None: none), cached on the layer with the modules it was built from
    and built again when the layer holds others (LoRA wraps linears after load)."""
    global _bound
    modules = _modules_of(layer)
    cached = layer.__dict__.get("_decode_plan")
    if cached is not None and cached[0] == modules:
        return cached[1]
    if not _bound:
        _bind_kernels()
        _bound = True
    plan = LayerPlan.build(layer)
    layer.__dict__["_decode_plan"] = (modules, plan)
    return plan


def decode_plans(
    layers: Sequence[nn.Module],
    hidden: torch.Tensor,
    kv_caches: Sequence[KVCache | None],
    md: InputMetadata,
) -> list[LayerPlan] | None:
    """The plans of `layers` when this step takes the fast path, else None (the general
    path): decodes only, one token each, fewer than every matmul's token limit, float32
    hidden states [T, hidden] contiguous on the CPU, float32 caches on every layer, and the
    C++ kernels available (VLLM_PP_DISABLE_KERNELS is honoured once per step)."""
    t = hidden.shape[0]
    if (
        md.num_prefills
        or md.num_decode_tokens != t
        or t == 0
        or not layers
        or hidden.dtype != DTYPE
        or hidden.dim() != 2
        or not hidden.is_cpu
        or not hidden.is_contiguous()
        or len(kv_caches) != len(layers)
        or not ops.is_available()
    ):
        return None
    plans = []
    for layer, kv_cache in zip(layers, kv_caches):
        plan = _plan_of(layer)
        if (
            plan is None
            or t >= plan.max_tokens
            or kv_cache is None
            or kv_cache[0].dtype != DTYPE
            or not kv_cache[0].is_cpu
        ):
            return None
        plans.append(plan)
    return plans
