"""K-quant blocks for tests: gguf-py (0.19) dequantizes Q4_K / Q5_K / Q6_K but cannot quantize
them, so these build the blocks: `random_kblocks` from random bytes with finite fp16 d / dmin
(every bit pattern of the scales and quants is a valid block), and `quantize_k` a simple
(not llama.cpp's optimal) quantizer of float weights into ggml's layout, for tiny models whose
dequantized weights must stay close to their float ones. gguf.quants.dequantize is the oracle
of the layout in both cases."""

from __future__ import annotations

from typing import Any

import numpy as np

QK_K = 256
# ggml type ids (gguf.GGMLQuantizationType) -> bytes per 256-weight super-block.
Q4_K, Q5_K, Q6_K = 12, 13, 14
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}


def random_kblocks(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, cols / 256 * block bytes] uint8: random bytes, d (and dmin) finite fp16 ~0.002."""
    rng = np.random.default_rng(seed)
    nb = cols // QK_K
    raw = rng.integers(0, 256, size=(rows, nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    halves = (np.abs(rng.standard_normal((rows, nb, 2))) * 0.002).astype(np.float16)
    halves[0, 0, 0] = np.float16(-3e-6)  # a negative subnormal d: the fp16 edge cases
    as_bytes = halves.view(np.uint8).reshape(rows, nb, 4)
    if qtype == Q6_K:
        raw[:, :, 208:210] = as_bytes[:, :, :2]  # d at the end
    else:
        raw[:, :, 0:4] = as_bytes  # d, dmin at the start
    return raw.reshape(rows, -1)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [nb, 8] -> ggml's 12 bytes (inverse of get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _quantize_q4k_q5k(x: np.ndarray, qtype: int) -> np.ndarray:
    """x [nb, 256] float32 -> [nb, 144 | 176] uint8 (asymmetric: w ~ d * sc * q - dmin * m)."""
    nb = x.shape[0]
    levels = 15 if qtype == Q4_K else 31
    groups = x.reshape(nb, 8, 32)
    low = np.minimum(groups.min(-1), 0.0)  # [nb, 8]
    scale = (groups.max(-1) - low) / levels
    d = _fp16(scale.max(-1) / 63)  # [nb]
    dmin = _fp16(-low.min(-1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(scale / d32), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin32 > 0, np.rint(-low / dmin32), 0).clip(0, 63).astype(np.uint8)
        step = (d32 * sc)[:, :, None]
        q = np.where(step > 0, np.rint((groups + (dmin32 * m)[:, :, None]) / step), 0)
    q = q.clip(0, levels).astype(np.uint8)  # [nb, 8, 32]
    low4 = (q & 0xF).reshape(nb, 4, 2, 32)
    qs = (low4[:, :, 0] | (low4[:, :, 1] << 4)).reshape(nb, 128)
    head = [d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2)]
    head.append(_pack_scales(sc, m))
    if qtype == Q5_K:
        bits = (q >> 4) & 1  # [nb, 8, 32]: group g's fifth bits go to bit g of qh
        qh = (bits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
        head.append(qh)
    return np.concatenate([*head, qs], axis=1)


def _quantize_q6k(x: np.ndarray) -> np.ndarray:
    """x [nb, 256] float32 -> [nb, 210] uint8 (symmetric: w ~ d * sc * (q - 32))."""
    nb = x.shape[0]
    groups = x.reshape(nb, 16, 16)
    scale = np.abs(groups).max(-1) / 31  # [nb, 16]
    d = _fp16(scale.max(-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(scale / d32), 0).clip(-128, 127).astype(np.int8)
        step = (d32 * sc)[:, :, None]
        q = np.where(step != 0, np.rint(groups / step), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # [nb, half, group, l]
    ql = np.zeros((nb, 2, 64), np.uint8)
    qh = np.zeros((nb, 2, 32), np.uint8)
    for i in range(4):
        ql[:, :, 32 * (i & 1) : 32 * (i & 1) + 32] |= (q[:, :, i] & 0xF) << (4 * (i >= 2))
        qh |= (q[:, :, i] >> 4) << (2 * i)
    return np.concatenate(
        [
            ql.reshape(nb, 128),
            qh.reshape(nb, 64),
            sc.view(np.uint8),
            d.view(np.uint8).reshape(nb, 2),
        ],
        axis=1,
    )


def quantize_k(weight: Any, qtype: int) -> np.ndarray:
    """A float weight [rows, cols] (cols a multiple of 256) -> its K-quant blocks
    [rows, cols / 256 * block bytes] uint8 (gguf.GGUFWriter.add_tensor(..., raw_dtype=qtype))."""
    x = np.asarray(weight, dtype=np.float32)
    rows, cols = x.shape
    if cols % QK_K:
        raise ValueError(f"cols ({cols}) must be a multiple of {QK_K}")
    flat = x.reshape(-1, QK_K)
    blocks = _quantize_q6k(flat) if qtype == Q6_K else _quantize_q4k_q5k(flat, qtype)
    return blocks.reshape(rows, -1)
