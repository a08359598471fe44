"""A prefill chunk's attention over its cached context, in one run: the C++ kernel
(csrc/prefill_attention.cpp) against the path it replaced (the context's K/V gathered from the
cache and torch's SDPA with a boolean mask, what `prefill_attention_with_context` runs with the
kernels off).

    python -m benchmarks.prefill_attention                   # SmolLM2's heads, 4k tokens
    python -m benchmarks.prefill_attention --chunks 128,256,512 --contexts 0,1024,3584

SmolLM2-135M's attention (9 query heads sharing 3 KV heads of 64 dims, blocks of 16) for each
chunk size and context length, one thread. The outputs of both paths are compared first. The
GFLOP/s column counts the useful work of causal attention (4 x D flops per visible query-key
pair and head), so the masked pairs SDPA also computes are not counted.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from benchmarks.common import print_table, write_json

if TYPE_CHECKING:
    import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--chunks", default="128,256,512", help="chunk sizes (query rows)")
    p.add_argument("--contexts", default="0,1024,3584", help="cached tokens before the chunk")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from vllm import _custom_ops as ops

    # The SDPA runs switch the kernels off and on again: not a line each time.
    logging.getLogger(ops.__name__).setLevel(logging.WARNING)
    if not ops.is_available():
        raise SystemExit("the C++ kernels are not built: nothing to compare")
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_size = (int(v) for v in args.heads.split(","))
    block_size, scale = 16, head_size**-0.5
    gen = torch.Generator().manual_seed(0)
    rows = []
    for chunk in [int(c) for c in args.chunks.split(",")]:
        for context in [int(c) for c in args.contexts.split(",")]:
            total = context + chunk
            blocks = -(-total // block_size)
            shape = (blocks, block_size, kv_heads, head_size)
            cache = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            table = torch.randperm(blocks, generator=gen)
            query = torch.randn(chunk, heads, head_size, generator=gen)

            kernel, sdpa = _paths(query, cache, table, context, scale)
            torch.testing.assert_close(kernel(), sdpa(), rtol=1e-4, atol=1e-5)
            times = {
                name: _time(fn, args.repeats) for name, fn in (("sdpa", sdpa), ("kernel", kernel))
            }
            pairs = chunk * context + chunk * (chunk + 1) / 2
            flops = 4 * head_size * heads * pairs
            rows.append(
                {
                    "chunk": chunk,
                    "context": context,
                    "sdpa_ms": round(times["sdpa"] * 1e3, 2),
                    "kernel_ms": round(times["kernel"] * 1e3, 2),
                    "sdpa_gflops": round(flops / times["sdpa"] / 1e9, 1),
                    "kernel_gflops": round(flops / times["kernel"] / 1e9, 1),
                    "speedup": round(times["sdpa"] / times["kernel"], 2),
                }
            )
    print(
        f"heads {heads}/{kv_heads}, head size {head_size}, {args.threads} thread(s), "
        f"best of {args.repeats}"
    )
    print_table(
        ["chunk", "context", "SDPA ms", "kernel ms", "SDPA GFLOP/s", "kernel GFLOP/s", "speedup"],
        [
            [
                r["chunk"],
                r["context"],
                r["sdpa_ms"],
                r["kernel_ms"],
                r["sdpa_gflops"],
                r["kernel_gflops"],
                f"{r['speedup']:.2f}x",
            ]
            for r in rows
        ],
    )
    write_json(args.output_json, {"threads": args.threads, "rows": rows})


def _paths(
    query: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    table: torch.Tensor,
    context: int,
    scale: float,
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """The kernel, and the layer function with the kernels switched off (SDPA's path)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.attention import prefill_attention_with_context

    def kernel() -> torch.Tensor:
        return ops.prefill_attention_paged(query, *cache, table, context, scale)

    def sdpa() -> torch.Tensor:
        os.environ[ops.DISABLE_ENV] = "1"
        ops.reset_availability()
        try:
            return prefill_attention_with_context(query, cache, table, context, scale)
        finally:
            del os.environ[ops.DISABLE_ENV]
            ops.reset_availability()

    return kernel, sdpa


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Best of `repeats` calls, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


if __name__ == "__main__":
    main()
