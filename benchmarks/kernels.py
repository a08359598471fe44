"""Decode attention per call: the C++ kernel (vllm._C) against the torch fallback.

SmolLM2-135M's attention shapes (H=9, Hkv=3, D=64, block 16), shuffled block tables, context
lengths within 10% of the target. Prints a markdown table; min and median over the repetitions
(the min is the least disturbed by other load on the machine).

    python -m benchmarks.kernels [--reps 20]
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable

import torch

from vllm import _custom_ops as ops
from vllm.model_executor.layers.attention import paged_decode_attention

H, HKV, D, BLOCK = 9, 3, 64, 16

Case = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]


def make(batch: int, ctx: int, dtype: torch.dtype, seed: int = 0) -> Case:
    """query, (key_cache, value_cache), block_tables, context_lens for one decode step."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(ctx - ctx // 10, ctx + ctx // 10 + 1, (batch,), generator=gen)
    max_blocks = (int(lens.max()) + BLOCK - 1) // BLOCK
    num_blocks = batch * max_blocks + 8
    key_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks]
    query = torch.randn(batch, H, D, generator=gen).to(dtype)
    return query, (key_cache, value_cache), tables.view(batch, max_blocks), lens


def timeit(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(min, median) seconds per call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[0], times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not ops._LOADED:
        raise SystemExit("vllm._C is not built: pip install --no-deps --no-build-isolation -e .")
    print(f"kernel ISA: {ops.cpu_isa()}; H={H} Hkv={HKV} D={D} block={BLOCK}")
    print(
        "| threads | dtype | batch | ctx | torch ms (min / median) | kernel ms (min / median) "
        "| speedup |"
    )
    print("|---|---|---|---|---|---|---|")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for batch in (32, 64):
                for ctx in (200, 1000):
                    query, cache, tables, lens = make(batch, ctx, dtype)
                    run = functools.partial(
                        paged_decode_attention, query, cache, tables, lens, int(lens.max()), 0.125
                    )

                    os.environ[ops.DISABLE_ENV] = "1"
                    ops.reset_availability()
                    fallback = timeit(run, args.reps)
                    os.environ[ops.DISABLE_ENV] = "0"
                    ops.reset_availability()
                    kernel = timeit(run, 3 * args.reps)
                    name = str(dtype).removeprefix("torch.")
                    print(
                        f"| {threads} | {name} | {batch} | {ctx} "
                        f"| {fallback[0] * 1e3:.2f} / {fallback[1] * 1e3:.2f} "
                        f"| {kernel[0] * 1e3:.3f} / {kernel[1] * 1e3:.3f} "
                        f"| {fallback[0] / kernel[0]:.1f}x |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
