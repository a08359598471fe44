"""The numpy reference of the int8-activation GGUF matmul (csrc/quant_gguf_vnni.cpp,
llama.cpp's arithmetic) for Q4_0 / Q4_1 / Q8_0 blocks: the activations quantized per
32-element block exactly as the kernel does (fp32 IEEE operations), the integer dot products
done exactly (int64), the scaling in float64."""

from __future__ import annotations

import numpy as np

BLOCK = 32
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
SCALE_HALVES = {Q4_0: 1, Q4_1: 2, Q8_0: 1}  # fp16 d (and Q4_1's m) at each block's start


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """rows x cols weights as random blocks in the file's layout [rows, cols / 32 * bytes]:
    random quant bytes, finite fp16 scales (and minima) ~0.02."""
    qtype = int(qtype)
    rng = np.random.default_rng(seed)
    nb = cols // BLOCK
    raw = rng.integers(0, 256, size=(rows, nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    n = SCALE_HALVES[qtype]
    scales = (rng.standard_normal((rows, nb, n)) * 0.02).astype(np.float16)
    raw[:, :, : 2 * n] = scales.view(np.uint8).reshape(rows, nb, -1)
    return raw.reshape(rows, -1)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, K] float32 -> (q [T, K] int8, d [T, K / 32] float32): per block amax = max |x|,
    d = amax / 127, q = round-half-even(x * (1 / d)), 0 where d = 0; every step in fp32."""
    x = np.asarray(x, dtype=np.float32)
    t, k = x.shape
    xb = x.reshape(t, k // BLOCK, BLOCK)
    d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    return q.reshape(t, k), d


def weight_quants(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """File-layout blocks [N, row bytes] -> (the integers the kernel multiplies as stored,
    [N, B, 32] int64: unsigned nibbles for Q4, the signed int8 for Q8_0; d [N, B] and m [N, B]
    float64, m = 0 except for Q4_1)."""
    qtype = int(qtype)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, BLOCK_BYTES[qtype])
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = np.zeros_like(d)
    if qtype == Q4_1:
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    quants = blocks[:, :, 2 * SCALE_HALVES[qtype] :]
    if qtype == Q8_0:
        q = quants.view(np.int8).astype(np.int64)
    else:
        q = np.concatenate([quants & 15, quants >> 4], axis=-1).astype(np.int64)
    return q, d, m


def linear_q8(x: np.ndarray, raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """The int8-activation matmul x [T, K] @ W^T for W in file-layout blocks -> (y [T, N]
    float64, the sum of the magnitudes the kernel adds per result [T, N], for error bounds).

    Per block: Q4_0 dw * dx * sum((qw - 8) qx), Q4_1 dw * dx * sum(qw qx) + mw * dx * sum(qx),
    Q8_0 dw * dx * sum(qw qx); the integer sums exact."""
    qtype = int(qtype)
    qx, dx = quantize_q8(x)
    t, k = qx.shape
    qx3 = qx.reshape(t, k // BLOCK, BLOCK).astype(np.int64)  # [T, B, 32]
    qw, dw, mw = weight_quants(raw, qtype)  # [N, B, 32], [N, B], [N, B]
    bias = {Q4_0: 8, Q4_1: 0, Q8_0: 0}[qtype]
    isum = np.einsum("nbi,tbi->tnb", qw - bias, qx3)  # [T, N, B], exact
    dxw = dx.astype(np.float64)[:, None, :] * dw[None, :, :]  # [T, N, B]
    sums = qx3.sum(axis=-1)  # [T, B]
    mterm = mw[None, :, :] * (dx.astype(np.float64) * sums)[:, None, :]
    y = (dxw * isum + mterm).sum(axis=-1)
    # What the kernel adds in magnitude: its unsigned weights (Q4 nibbles; Q8_0 stored + 128)
    # times |qx|, and the correction -8 or -128 * sum(qx) of Q4_0 / Q8_0.
    shift = {Q4_0: 0, Q4_1: 0, Q8_0: 128}[qtype]
    corr = {Q4_0: 8, Q4_1: 0, Q8_0: 128}[qtype]
    abs_qx = np.abs(qx3)
    mag_int = np.einsum("nbi,tbi->tnb", np.abs(qw + shift), abs_qx)
    mag_int = mag_int + corr * abs_qx.sum(axis=-1)[:, None, :]
    magnitude = (np.abs(dxw) * mag_int + np.abs(mterm)).sum(axis=-1)
    return y, magnitude
