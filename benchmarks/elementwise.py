"""The fused elementwise kernels (csrc/elementwise.cpp) against the torch code, per call.

Through the layers, as the model calls them, on SmolLM2-135M's shapes: hidden 576, 9 query /
3 KV heads of 64 (q/k strided slices of a fused qkv), intermediate 1536. "add + norm" is the
residual add plus RMSNorm the decoder layer fuses. One thread by default. Prints a markdown
table; min and median over the repetitions (the min is the least disturbed by other load).

    python -m benchmarks.elementwise [--reps 30] [--threads 1] [--tokens 1 128 2048]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from vllm import _custom_ops as ops
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary import RotaryEmbedding

HIDDEN, H, HKV, D, INTER = 576, 9, 3, 64, 1536


def timeit(fn: Callable[[], object], reps: int, inner: int) -> tuple[float, float]:
    """(min, median) seconds per call, each repetition timing `inner` calls."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    times.sort()
    return times[0], times[len(times) // 2]


def cases(tokens: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """name -> a call of the layer on fresh inputs (the in-place kernels just keep updating
    theirs: the values stay bounded, which is all the timing needs)."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    rope = RotaryEmbedding(D, 8192)
    qkv = torch.randn(tokens, (H + 2 * HKV) * D, generator=gen).to(dtype)
    q, k = qkv[:, : H * D], qkv[:, H * D : (H + HKV) * D]
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    act = SiluAndMul()
    gate_up = torch.randn(tokens, 2 * INTER, generator=gen).to(dtype)
    return {
        "rms_norm": lambda: norm(x),
        "add + rms_norm": lambda: norm(x, residual),
        "rotary": lambda: rope(positions, q, k),
        "silu_and_mul": lambda: act(gate_up),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 2048])
    args = parser.parse_args()
    if not ops._LOADED:
        raise SystemExit("vllm._C is not built: pip install --no-deps --no-build-isolation -e .")
    torch.set_num_threads(args.threads)
    print(f"kernel ISA: {ops.cpu_isa()}; threads: {args.threads}")
    print("| op | dtype | tokens | torch us (min / median) | kernel us (min / median) | speedup |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for tokens in args.tokens:
                inner = max(1, 4096 // tokens)  # ~the same work per repetition
                for name, run in cases(tokens, dtype).items():
                    os.environ[ops.DISABLE_ENV] = "1"
                    ops.reset_availability()
                    fallback = timeit(run, args.reps, inner)
                    os.environ[ops.DISABLE_ENV] = "0"
                    ops.reset_availability()
                    kernel = timeit(run, args.reps, inner)
                    print(
                        f"| {name} | {str(dtype).removeprefix('torch.')} | {tokens} "
                        f"| {fallback[0] * 1e6:.1f} / {fallback[1] * 1e6:.1f} "
                        f"| {kernel[0] * 1e6:.1f} / {kernel[1] * 1e6:.1f} "
                        f"| {fallback[0] / kernel[0]:.1f}x |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
