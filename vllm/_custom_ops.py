"""The C++ CPU kernels of csrc/ (built by setup.py as `vllm._C`): availability and wrappers.

Importing `vllm._C` registers the ops as `torch.ops.vllm_pp.*`. When the extension was not
built (no compiler, a failed build, an install without torch), `is_available()` is False and
the layers keep their pure-torch paths. `VLLM_PP_DISABLE_KERNELS=1` forces that
fallback; it is read once (`reset_availability()` reads it again: tests and benchmarks that
compare both paths call it after changing the variable).
"""

from __future__ import annotations

import torch

from vllm import envs
from vllm.logger import init_logger

logger = init_logger("vllm.custom_ops")

DISABLE_ENV = "VLLM_PP_DISABLE_KERNELS"

# dtypes the attention kernel implements (the cache write copies bytes and takes any dtype).
ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
# dtypes the fused elementwise kernels (RMSNorm, RoPE, SwiGLU; csrc/elementwise.cpp) implement.
ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)
# dtypes the batched LoRA update (csrc/lora.cpp) implements.
LORA_DTYPES = (torch.float32, torch.bfloat16)

try:
    import vllm._C  # noqa: F401  (registers torch.ops.vllm_pp)

    _LOADED = True
except (ImportError, OSError) as exc:
    _LOADED = False
    # A WARNING either way, with what the fallback costs: an install whose build failed
    # quietly would otherwise look like a working one, only bigger and slower.
    reason = (
        "not built (no vllm._C)"
        if isinstance(exc, ModuleNotFoundError) and exc.name == "vllm._C"
        else f"failed to load ({exc})"  # built for another torch, or a broken toolchain
    )
    logger.warning(
        "C++ CPU kernels %s; using the torch code instead. This costs: GGUF weights are "
        "dequantized to dense at load (about 4x the memory of Q4/Q8 blocks) and decode is "
        "slower; attention, RMSNorm, RoPE, sampling and LoRA run in pure torch. Reinstall "
        "with torch importable and --no-build-isolation (VLLM_PP_REQUIRE_KERNELS=1 makes a "
        "failed build an error).",
        reason,
    )

# VLLM_PP_DISABLE_KERNELS as read (None: not yet): is_available() runs ~180 times per decode
# step on the general path, so the variable is parsed once, not per call.
_disabled: bool | None = None


def is_available() -> bool:
    """True when the extension is loaded and not disabled by VLLM_PP_DISABLE_KERNELS=1 (read
    once, at the first call; `reset_availability` reads it again)."""
    if not _LOADED:
        return False
    disabled = _disabled
    if disabled is None:
        disabled = _read_disabled()
    return not disabled


def _read_disabled() -> bool:
    global _disabled
    _disabled = envs.get_bool(DISABLE_ENV)
    if _disabled:
        logger.info("%s=1: using the torch code instead of the C++ kernels.", DISABLE_ENV)
    return _disabled


def reset_availability() -> None:
    """Forget VLLM_PP_DISABLE_KERNELS as read: the next is_available() reads it again (for
    tests and benchmarks that change it while running)."""
    global _disabled
    _disabled = None


def supports_attention(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether paged_attention_decode can run these tensors (CPU, float32/bfloat16, one dtype)."""
    return (
        query.device.type == "cpu"
        and key_cache.device.type == "cpu"
        and query.dtype == key_cache.dtype
        and query.dtype in ATTENTION_DTYPES
        and is_available()
    )


def supports_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> bool:
    """Whether prefill_attention_paged can run this chunk: CPU float32 query and cache, a head
    size that is a multiple of 16, no sliding window and no soft-cap (those keep SDPA)."""
    return (
        sliding_window is None
        and logits_soft_cap is None
        and query.device.type == "cpu"
        and key_cache.device.type == "cpu"
        and query.dtype == torch.float32
        and key_cache.dtype == torch.float32
        and query.shape[-1] % 16 == 0
        and is_available()
    )


def supports_cache_write(key: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether write_to_kv_cache can run these tensors (CPU, same dtype)."""
    return (
        key.device.type == "cpu"
        and key_cache.device.type == "cpu"
        and key.dtype == key_cache.dtype
        and is_available()
    )


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous int64 tensor: itself when it already is (the engine's metadata, once
    per layer and step), else a converted copy."""
    if t.dtype == torch.int64 and t.is_contiguous():
        return t
    return t.to(torch.int64).contiguous()


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache; see csrc/attention.cpp.

    query [B, H, D] (rows may be strided); caches [num_blocks, block_size, Hkv, D];
    block_tables [B, max_blocks]; context_lens [B]. Returns a new contiguous [B, H, D].
    `sliding_window` W: only the last W positions are seen (blocks before them are not read);
    `logits_soft_cap` c: scores become c * tanh(scores / c) before the softmax.
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.stride(-1) != 1:
        query = query.contiguous()
    torch.ops.vllm_pp.paged_attention_decode.default(
        out,
        query,
        key_cache,
        value_cache,
        as_int64(block_tables),
        as_int64(context_lens),
        float(scale),
        int(sliding_window or 0),  # the kernel's "none" is 0
        float(logits_soft_cap or 0.0),
    )
    return out


def prefill_attention_paged(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one prefill chunk over its cached context; see
    csrc/prefill_attention.cpp. query [L, H, D] at positions context_len .. context_len + L - 1
    (its K/V already in the cache); caches [num_blocks, block_size, Hkv, D]; block_table
    [>= blocks] of the sequence. Returns a new [L, H, D]."""
    if query.stride(-1) != 1 or query.stride(1) != query.shape[2]:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    torch.ops.vllm_pp.prefill_attention_paged.default(
        out,
        query,
        key_cache,
        value_cache,
        as_int64(block_table),
        int(context_len),
        float(scale),
    )
    return out


def write_to_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy each token's K/V [T, Hkv, D] to its flat cache slot; slots < 0 are skipped."""
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    torch.ops.vllm_pp.write_to_kv_cache.default(
        key, value, key_cache, value_cache, as_int64(slot_mapping)
    )


def supports_elementwise(*tensors: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels (rms_norm, fused_add_rms_norm, silu_and_mul) can
    run these tensors: all on the CPU, of one dtype, float32 or bfloat16."""
    # Called several times per decoder layer: a plain loop and `is_cpu` (a generator and
    # `device.type` cost a microsecond or so more per call).
    dtype = tensors[0].dtype
    if dtype not in ELEMENTWISE_DTYPES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return False
    return is_available()


def supports_rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor
) -> bool:
    """Whether rotary_embedding can run: CPU float32/bfloat16 q/k of one dtype, with the
    float32 cos/sin caches RotaryEmbedding builds."""
    return (
        cos_cache.is_cpu and cos_cache.dtype == torch.float32 and supports_elementwise(query, key)
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., width] as a 2-D [T, width] with a unit last stride (a view when possible)."""
    if x.dim() == 2 and x.stride(1) == 1:  # the model's case: no reshape, no copy
        return x
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) with HF LlamaRMSNorm's casts; see
    csrc/elementwise.cpp. x [..., hidden] (rows may be strided); weight [hidden], contiguous.
    Returns a new contiguous tensor of x's shape."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    torch.ops.vllm_pp.rms_norm.default(out, x2, weight, eps)
    return out if x2 is x else out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual = x + residual, then x = rms_norm(residual, weight, eps).

    x, residual [T, hidden] with a unit last stride (rows may be strided): both are written.
    weight [hidden], contiguous.
    """
    torch.ops.vllm_pp.fused_add_rms_norm.default(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """In place: rotate-half RoPE of query [T, H*D] and key [T, Hkv*D] (unit last stride, rows
    may be strided, e.g. column slices of a fused qkv) at positions [T], from float32 caches
    [max_position, D], contiguous. RuntimeError, leaving q/k untouched, if a position is out of
    range."""
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    torch.ops.vllm_pp.rotary_embedding.default(
        positions, query, key, head_size, cos_cache, sin_cache
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] holding (gate, up) -> new contiguous silu(gate) * up, [..., I]."""
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], x2.shape[1] // 2, dtype=x.dtype, device=x.device)
    torch.ops.vllm_pp.silu_and_mul.default(out, x2)
    return out if x2 is x else out.view(*x.shape[:-1], x.shape[-1] // 2)


def supports_sampling(logits: torch.Tensor) -> bool:
    """Whether sample_from_logits can run on these logits (CPU float32 [N, V])."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and is_available()
    )


def sample_from_logits(
    logits: torch.Tensor, draw_rows: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampler's passes over the vocabulary in one call; see csrc/sampler.cpp.

    logits [N, V] float32; draw_rows [M] (the row of each draw); uniforms [M] in (0, 1].
    Returns (tokens [M] int64: inverse-CDF draws, argmax [N] int64, lse [N] float32).
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, num_draws = logits.shape[0], draw_rows.numel()
    tokens = torch.empty(num_draws, dtype=torch.int64)
    argmax = torch.empty(num_rows, dtype=torch.int64)
    lse = torch.empty(num_rows, dtype=torch.float32)
    torch.ops.vllm_pp.sample_from_logits(
        logits,
        draw_rows.to(torch.int64).contiguous(),
        uniforms.to(torch.float32).contiguous(),
        tokens,
        argmax,
        lse,
    )
    return tokens, argmax, lse


def cpu_isa() -> str:
    """The instruction set the attention kernel uses: "avx512", "avx2" or "generic"."""
    return torch.ops.vllm_pp.cpu_isa()


def supported_isas() -> list[str]:
    """The kernel variants this CPU can run, lowest first ([] without the extension)."""
    if not _LOADED:
        return []
    order = ["generic", "avx2", "avx512"]
    return order[: order.index(cpu_isa()) + 1]


def set_cpu_isa(isa: str) -> None:
    """Run the attention kernel with a lower instruction set (for tests); ValueError if the CPU
    lacks it."""
    try:
        torch.ops.vllm_pp.set_cpu_isa(isa)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from exc


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [T, K] (float32/bfloat16, unit last stride) @ W^T -> [T, N] in x's dtype, W [N, K]
    held as GGUF blocks weight [N, K / block weights * block bytes] uint8 of ggml type `qtype`
    (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8: 32-weight blocks; Q4_K = 12, Q5_K = 13, Q6_K = 14: 256),
    rows regrouped by quantization.gguf.repack_gguf_rows; see csrc/quant_gguf.cpp."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    torch.ops.vllm_pp.gguf_linear.default(out, x, weight, qtype)
    return out


def gguf_linear_panels(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """The same product as gguf_linear for many float32 tokens (a prefill chunk), without a
    dense copy of W: 16 rows at a time decoded into a cached panel, every token multiplied
    into it (csrc/quant_gguf.cpp). x [T, K] float32, unit last stride -> [T, N]."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    torch.ops.vllm_pp.gguf_linear_panels.default(out, x, weight, qtype)
    return out


def gguf_dequantize(
    weight: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """GGUF blocks weight [N, row bytes] uint8 of ggml type `qtype` (rows regrouped as for
    gguf_linear) -> dense [N, cols] in dtype
    (float32 or bfloat16), the exact values of ggml's dequantization (bf16: rounded once)."""
    out = torch.empty(weight.shape[0], cols, dtype=dtype)
    torch.ops.vllm_pp.gguf_dequantize.default(out, weight, qtype)
    return out


def gguf_linear_q8(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """gguf_linear with int8 activations (csrc/quant_gguf_vnni.cpp; Q4_0 = 2, Q4_1 = 3,
    Q8_0 = 8): x [T, K] quantized per 32-element block to int8 with an fp32 scale, the
    integer dot products per block scaled by the weight's and x's scales -> [T, N] in x's
    dtype. Not the dequantized weights' result: llama.cpp's arithmetic."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    torch.ops.vllm_pp.gguf_linear_q8.default(out, x, weight, qtype)
    return out


def gguf_quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantization of gguf_linear_q8: x [T, K] -> (q [T, K] int8,
    scales [T, K / 32] float32), x ~ q * scale per 32-element block."""
    q = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.float32)
    torch.ops.vllm_pp.gguf_quantize_q8.default(q, scales, x)
    return q, scales


def lora_apply(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b_t: torch.Tensor,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    scale: torch.Tensor,
    ranks: torch.Tensor,
    slice_offsets: list[int],
) -> None:
    """In place, one layer's batched LoRA update; see csrc/lora.cpp. For each adapted token
    tokens[j] (int64 [N], sorted by slot) of slot slots[j], and each output slice i (columns
    slice_offsets[i]..slice_offsets[i+1] of out) with rank ranks[s, i] > 0:
    out[t, slice] += (x[t] @ A_i^T) @ B_i^T * scale[s], A_i the slice's `rank` rows of
    lora_a [S, n*R, in] and B_i^T those of lora_b_t [S, n*R, out_width]. x [T, in] and out
    [T, out_width] float32/bfloat16 with a unit last stride; scale float32 [S]; ranks int64
    [S, n]."""
    torch.ops.vllm_pp.lora_apply.default(
        out, x, lora_a, lora_b_t, tokens, slots, scale, ranks, slice_offsets
    )
