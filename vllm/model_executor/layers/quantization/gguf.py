"""GGUF weight-only quantization (`--quantization gguf`): linear layers keep the file's blocks.

The loader (`gguf_loader.iter_gguf_weights(..., keep_quantized=True)`) yields a linear layer's
weight as `GGUFBlocks`: the raw rows of the GGUF tensor (or of this TP rank's shard: whole rows
for a column-parallel layer, whole blocks of each row for a row-parallel one). A linear layer
built while `quantized_linears()` is active has a meta (memory-less) weight whose
`gguf_sink` collects those rows at their offsets (q, k and v into one fused qkv, ...); after
loading, `finalize_quantized(model)` turns each sink into a `GGUFWeight` the layer multiplies
with. Q4_0, Q4_1 and Q8_0 rows are regrouped once (`repack_gguf_rows`: the same bytes, a row's
scales together), the K-quants Q4_K, Q5_K and Q6_K kept as in the file (256-weight
super-blocks), and all go to the C++ kernel (csrc/quant_gguf.cpp) with fp32 or bf16
activations; other types (F16, other quantizations), other activation dtypes, or a build
without the kernels are dequantized at load to the activation dtype.

At one or a few tokens per step the kernel reads each block once; from `dense_min_tokens`
tokens on (prefill), dequantizing the layer to a dense matrix and running the GEMM is faster
(the crossover measured by benchmarks/gguf_quant.py, docs/PERFORMANCE.md).

VLLM_PP_GGUF_ACTIVATIONS=int8 (read once per layer at load) sends Q4_0/Q4_1/Q8_0 layers below
`dense_min_tokens` to the int8-activation kernel (csrc/quant_gguf_vnni.cpp, llama.cpp's
arithmetic: faster, but not the dequantized weights' results, so not the default).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm import _custom_ops as ops
from vllm import envs

logger = logging.getLogger("vllm.quantization.gguf")

# ggml type ids the kernel runs (ggml.h): Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K.
KERNEL_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# The K-quants: blocks (super-blocks) of 256 weights, kept in the file's layout.
K_QUANT_TYPES = frozenset({12, 13, 14})
# Activation dtypes the kernel takes.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# From this many tokens in one matmul on, dequantize + GEMM is used instead of the block kernel
# (`dense_min_tokens`). Measured with `python -m benchmarks.gguf_quant` (one thread, AVX-512
# kernel, ms of thread CPU time, kernel / dequantize + GEMM): SmolLM2's Q4_1 layers break even
# at ~48 tokens (gate/up 3072 x 576: 2.39 / 2.39), 32 (down 576 x 1536: 0.70 / 0.70) and ~28
# (o 576 x 576: 0.30 / 0.29 at 32), within 5% of each other from 32 to 64 -> 32. A Q8_0 layer
# of the gate/up's shape is still 1.1x faster in the kernel at 64 tokens (3.34 / 3.72): its
# dequantization writes the same floats from more bytes -> 64. Above DENSE_LARGE_WEIGHTS
# weights (the dense fp32 copy, 32 MiB, no longer fits the last-level cache) dequantizing
# costs far more: the Q8_0 lm_head (49152 x 576) runs the kernel faster up to 256 tokens
# (237 / 265 ms) and the GEMM wins at 384 (373 / 348); a Q4_1 matrix of that size likewise
# (241 / 272 at 256) -> 384. K-quants (kernel: AVX-512 to 4 tokens, the rows decoded once
# from 5 on), 3072 x 1536 and 1536 x 3072 of each of Q4_K / Q5_K / Q6_K (3072 x 1536: the
# K-quant rows of benchmarks.gguf_quant's crossover table): the kernel is faster at 32 tokens
# in all six (e.g. Q4_K 4.72 / 6.10, Q6_K 5.12 / 5.48), the GEMM at 64 in four of the six
# (Q6_K 10.05 / 8.53; Q4_K 3072 x 1536 still 8.53 / 9.71) -> 48.
DENSE_MIN_TOKENS = 32
DENSE_MIN_TOKENS_Q8_0 = 64
DENSE_MIN_TOKENS_K = 48
DENSE_MIN_TOKENS_LARGE = 384
DENSE_LARGE_WEIGHTS = 8 << 20


# Bytes per block, and of its fp16 scale (+ Q4_1's fp16 minimum) at the block's start.
_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}
_SCALE_BYTES = {2: 2, 3: 4, 8: 2}


def repack_gguf_rows(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF rows [N, row_bytes] (blocks one after the other: scale(s), then quants) -> the
    kernels' layout of the same bytes [N, row_bytes]: each row's fp16 scales d of all blocks,
    then (Q4_1) their minima m, then the blocks' quants, so a row's scales are contiguous and
    widened to fp32 a vector at a time (csrc/quant_gguf.cpp). K-quant rows are kept as they
    are (their scales are decoded once per 256 weights)."""
    if qtype in K_QUANT_TYPES:
        return raw.contiguous()
    n, row_bytes = raw.shape
    blocks = raw.reshape(n, row_bytes // _BLOCK_BYTES[qtype], _BLOCK_BYTES[qtype])
    pieces = [blocks[:, :, 0:2].reshape(n, -1)]
    if qtype == 3:
        pieces.append(blocks[:, :, 2:4].reshape(n, -1))
    pieces.append(blocks[:, :, _SCALE_BYTES[qtype] :].reshape(n, -1))
    return torch.cat(pieces, dim=1).contiguous()


@dataclass
class GGUFBlocks:
    """Rows of a quantized GGUF tensor as stored: raw [rows, row_bytes] uint8 of ggml type
    `qtype`, standing for a [rows, cols] weight."""

    raw: torch.Tensor  # [rows, row_bytes] uint8
    qtype: int
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] weight (gguf's numpy dequantization)."""
        import gguf
        import numpy as np

        values = gguf.quants.dequantize(
            np.ascontiguousarray(self.raw.numpy()), gguf.GGMLQuantizationType(self.qtype)
        )
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape)


_ACTIVE = False


@contextlib.contextmanager
def quantized_linears(enabled: bool) -> Iterator[None]:
    """While active, linear layers built get a meta weight that collects GGUF blocks."""
    global _ACTIVE
    old, _ACTIVE = _ACTIVE, enabled
    try:
        yield
    finally:
        _ACTIVE = old


class _Sink:
    """Collects the rows loaded into a quantized linear's (meta) weight, at their offsets."""

    def __init__(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.segments: list[tuple[int, GGUFBlocks | torch.Tensor]] = []

    def add(self, target: torch.Tensor, loaded: Any, name: str) -> None:
        shape = tuple(loaded.shape)
        if shape != tuple(target.shape):
            raise ValueError(
                f"weight {name}: checkpoint shape {shape} does not match the model's "
                f"{tuple(target.shape)}."
            )
        # target is the weight or a slice of its rows: its offset gives the first row.
        self.segments.append((target.storage_offset() // self.cols, loaded))


def make_linear_weight(out_local: int, in_local: int) -> nn.Parameter:
    """A linear layer's weight [out_local, in_local]: dense in the default dtype, or, inside
    `quantized_linears(True)`, a meta tensor whose `gguf_sink` receives the GGUF rows."""
    if not _ACTIVE:
        return nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
    weight = nn.Parameter(torch.empty(out_local, in_local, device="meta"), requires_grad=False)
    weight.gguf_sink = _Sink(out_local, in_local)
    return weight


def load_into(param: torch.Tensor, loaded: Any, name: str) -> bool:
    """Route a checkpoint tensor to a quantized weight's sink; False if `param` has none."""
    base = param if param._base is None else param._base
    sink = getattr(base, "gguf_sink", None)
    if sink is None:
        return False
    sink.add(param, loaded, name)
    return True


def dense(loaded: Any) -> Any:
    """A checkpoint tensor as a dense tensor (GGUFBlocks dequantized to float32)."""
    return loaded.dequantize() if isinstance(loaded, GGUFBlocks) else loaded


def kernel_runs(qtype: int, dtype: torch.dtype) -> bool:
    """Whether the C++ kernel multiplies blocks of `qtype` with `dtype` activations here."""
    return qtype in KERNEL_TYPES and dtype in KERNEL_DTYPES and ops.is_available()


def dense_min_tokens(qtype: int, rows: int, cols: int) -> int:
    """Token count from which dequantize + GEMM beats the block kernel for a [rows, cols]
    weight of ggml type `qtype` (the measured crossover above)."""
    if rows * cols > DENSE_LARGE_WEIGHTS:
        return DENSE_MIN_TOKENS_LARGE
    if qtype in K_QUANT_TYPES:
        return DENSE_MIN_TOKENS_K
    return DENSE_MIN_TOKENS_Q8_0 if qtype == 8 else DENSE_MIN_TOKENS


# The types the int8-activation kernel runs (csrc/quant_gguf_vnni.cpp).
INT8_ACTIVATION_TYPES = frozenset({2, 3, 8})
ACTIVATION_MODES = ("float", "int8")


def int8_activations() -> bool:
    """Whether VLLM_PP_GGUF_ACTIVATIONS picks the int8-activation kernel ('int8') over the
    float one ('float', the default)."""
    mode = envs.get_str("VLLM_PP_GGUF_ACTIVATIONS").lower()
    if mode not in ACTIVATION_MODES:
        raise ValueError(
            f"VLLM_PP_GGUF_ACTIVATIONS must be one of {', '.join(ACTIVATION_MODES)}, got {mode!r}."
        )
    return mode == "int8"


BlockKernel = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def block_kernel(qtype: int, int8: bool) -> BlockKernel:
    """The kernel that multiplies activations with blocks of `qtype` below `dense_min_tokens`,
    called as kernel(x [T, K], raw [N, row_bytes], qtype) -> [T, N]: with `int8`, Q4_0/Q4_1/Q8_0
    through the int8-activation kernel, else the float one. The one place that picks it (the
    general path below, GGUFWeight's single-part path and the decoder's decode fast path)."""
    if int8 and qtype in INT8_ACTIVATION_TYPES:
        return ops.gguf_linear_q8
    return ops.gguf_linear


def panel_prefill() -> bool:
    """Whether float32 GGUF matmuls from `dense_min_tokens` on decode the weights panel by
    panel into the panel kernel (ops.gguf_linear_panels) instead of dequantize + GEMM: where
    dense float32 linears take column panels (packed_weight.choose_layout: AVX2 CPUs, or
    VLLM_CPU_LINEAR_LAYOUT=panels). One 4096-token SmolLM2 Q4_1 prompt at PP=2, with the
    prefill attention kernel: 18.7 -> 16.7 s; level at PP=1 (docs/PERFORMANCE.md)."""
    from vllm.model_executor.layers.packed_weight import choose_layout

    return choose_layout(torch.device("cpu"), torch.float32)[0] == "panels"


def gguf_linear(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: int,
    cols: int,
    int8: bool = False,
    panels: bool = False,
) -> torch.Tensor:
    """x [T, cols] (fp32/bf16, unit last stride) @ W^T, W the blocks raw [N, row_bytes] (in
    the kernels' layout, `repack_gguf_rows`): the block kernel for few tokens
    (`block_kernel`); from `dense_min_tokens` on, with `panels` (`panel_prefill`) and float32
    x the weights decoded panel by panel into the panel kernel, else dequantize + GEMM
    -> [T, N]."""
    if x.shape[0] >= dense_min_tokens(qtype, raw.shape[0], cols):
        if panels and x.dtype == torch.float32:
            return ops.gguf_linear_panels(x, raw, qtype)
        return F.linear(x, ops.gguf_dequantize(raw, qtype, cols, x.dtype))
    return block_kernel(qtype, int8)(x, raw, qtype)


class GGUFWeight(nn.Module):
    """A linear layer's weight [N, K] as GGUF blocks: one or more row ranges ("parts", e.g.
    q/k/v of different types), each blocks for the kernel or a dense matrix."""

    def __init__(
        self, parts: list[tuple[int | None, torch.Tensor]], cols: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.cols = cols
        self.dtype = dtype
        # Read once at load: the forward runs ~200 times per decode step.
        self.int8 = int8_activations()
        self.panels = dtype == torch.float32 and panel_prefill()  # needs the kernels
        self.qtypes: list[int | None] = []
        for i, (qtype, tensor) in enumerate(parts):
            self.register_buffer(f"part{i}", tensor, persistent=False)
            self.qtypes.append(qtype)
        # The decode step's case, taken without the general path's checks and lists (the
        # forward runs once per linear and step): one part of kernel blocks, and the token
        # count below which the block kernel runs (fixed per part: dense_min_tokens).
        only = self.qtypes[0] if len(parts) == 1 else None
        self._single_qtype = only
        self._single_max_tokens = (
            dense_min_tokens(only, parts[0][1].shape[0], cols) if only is not None else 0
        )
        self._single_kernel = block_kernel(only, self.int8) if only is not None else None

    @classmethod
    def from_sink(cls, sink: _Sink, dtype: torch.dtype, name: str) -> GGUFWeight:
        """Join the sink's segments (checked to cover every row once) into parts: consecutive
        blocks of one kernel type are concatenated; anything else is dequantized to dtype."""
        segments = sorted(sink.segments, key=lambda seg: seg[0])
        expected = 0
        for start, tensor in segments:
            if start != expected:
                raise ValueError(f"weight {name}: rows {expected}..{start} were not loaded.")
            expected += tensor.shape[0]
        if expected != sink.rows:
            raise ValueError(f"weight {name}: {expected} of {sink.rows} rows loaded.")
        parts: list[tuple[int | None, list[torch.Tensor]]] = []
        for _, tensor in segments:
            if isinstance(tensor, GGUFBlocks) and kernel_runs(tensor.qtype, dtype):
                qtype: int | None = tensor.qtype
                piece = repack_gguf_rows(tensor.raw, tensor.qtype)
            else:
                qtype, piece = None, dense(tensor).to(dtype)
            if parts and parts[-1][0] == qtype:
                parts[-1][1].append(piece)
            else:
                parts.append((qtype, [piece]))
        return cls(
            [(q, torch.cat(ts) if len(ts) > 1 else ts[0]) for q, ts in parts], sink.cols, dtype
        )

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f"part{i}") for i in range(len(self.qtypes))]

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as held (blocks and dense parts)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def is_quantized(self) -> bool:
        return any(q is not None for q in self.qtypes)

    def decode_matmul(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """For the decode fast path (models/llama_decode.py): (x [T, K] -> [T, N], the token
        count T must stay below), the single-part call `forward` makes for a 2-D input of the
        weight's dtype with a unit last stride and no bias; None for a weight of several parts
        or dense rows (those take `forward`)."""
        qtype, kernel, raw = self._single_qtype, self._single_kernel, self.part0
        if qtype is None or kernel is None:
            return None

        def matmul(x: torch.Tensor) -> torch.Tensor:
            return kernel(x, raw, qtype)

        return matmul, self._single_max_tokens

    def decode_blocks(self) -> tuple[torch.Tensor, int, bool] | None:
        """For the decode fast path's one-op layer (csrc/decode_layer.cpp): (blocks [N,
        row_bytes], ggml type, whether the kernel `decode_matmul` calls is the int8-activation
        one), or None when `decode_matmul` is or calls something else than the two C++ block
        kernels the op can call itself (a replaced kernel, e.g. a benchmark's stub)."""
        qtype, kernel = self._single_qtype, self._single_kernel
        if qtype is None or kernel not in (ops.gguf_linear, ops.gguf_linear_q8):
            return None
        return self.part0, qtype, kernel is ops.gguf_linear_q8

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight, dequantized -> [T, K] in dtype (an embedding lookup:
        the values the dense embedding would hold)."""
        assert len(self.qtypes) == 1 and self.qtypes[0] is not None
        picked = self.part0.index_select(0, ids)  # [T, row_bytes]
        return ops.gguf_dequantize(picked, self.qtypes[0], self.cols, self.dtype)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] (+ bias), in x's dtype."""
        qtype = self._single_qtype
        if (
            qtype is not None
            and bias is None
            and x.dim() == 2
            and x.shape[1] == self.cols
            and x.shape[0] < self._single_max_tokens
            and x.dtype == self.dtype
            and x.stride(-1) == 1
        ):
            # [T, K] -> [T, N]: what gguf_linear below does for these inputs, the same call.
            assert self._single_kernel is not None
            return self._single_kernel(x, self.part0, qtype)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.cols)
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        outs = []
        for qtype, tensor in zip(self.qtypes, self.tensors()):
            if qtype is None:
                outs.append(F.linear(flat, tensor))
            else:
                outs.append(gguf_linear(flat, tensor, qtype, self.cols, self.int8, self.panels))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # [T, N]
        if bias is not None:
            out = out + bias
        return out.view(*lead, out.shape[-1])


def finalize_quantized(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every collecting (meta) linear weight by its GGUFWeight (`module.quant`), or,
    when none of its rows are kernel blocks (an F32/F16 file), by a dense weight again, so such
    layers run exactly as without --quantization gguf; returns how many layers run quantized."""
    count = 0
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        sink = getattr(weight, "gguf_sink", None)
        if sink is None:
            continue
        quant = GGUFWeight.from_sink(sink, dtype, f"{name}.weight")
        del module.weight
        if quant.is_quantized:
            module.quant = quant
            count += 1
        else:
            dense_rows = torch.cat(quant.tensors()) if len(quant.qtypes) > 1 else quant.part0
            module.weight = nn.Parameter(dense_rows, requires_grad=False)
    return count


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """(weights, bytes) held by the model's GGUFWeights (tensors shared by a tied pair once)."""
    n = nbytes = 0
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, GGUFWeight):
            continue
        for tensor in module.tensors():
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            n += tensor.shape[0] * module.cols
            nbytes += tensor.numel() * tensor.element_size()
    return n, nbytes
