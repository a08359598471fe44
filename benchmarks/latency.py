"""Latency of one batch, after vLLM's benchmarks/benchmark_latency.py.

    python -m benchmarks.latency --batch-size 8 --input-len 32 --output-len 128 -pp 2

Runs `generate` on one batch of random token-id prompts (`ignore_eos`, so every request makes
exactly --output-len tokens) --num-iters times after --num-iters-warmup untimed runs, and prints
the average and percentiles of the end-to-end latency. The iteration defaults are smaller than
vLLM's (10 warm-up, 30 timed) because a CPU run takes seconds per iteration.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.common import write_json

PERCENTILES = [10, 25, 50, 75, 90, 99]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="Model (default: bundled SmolLM2).")
    p.add_argument("--input-len", type=int, default=32, help="Prompt length in tokens.")
    p.add_argument("--output-len", type=int, default=128, help="New tokens per request.")
    p.add_argument("--batch-size", type=int, default=8, help="Requests per batch.")
    p.add_argument("--num-iters-warmup", type=int, default=2, help="Untimed iterations.")
    p.add_argument("--num-iters", type=int, default=5, help="Timed iterations.")
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="Pipeline stages (one Ray worker each).",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="Model dtype (auto: the model's, fp32 if none).",
    )
    p.add_argument("--kv-cache-space", type=float, default=4.0, help="KV GiB per stage (CPU).")
    p.add_argument("--seed", type=int, default=0, help="Seed of prompts and sampling.")
    p.add_argument("--output-json", default=None, help="Write the latencies to this file.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        pipeline_parallel_size=args.pipeline_parallel_size,
        kv_cache_space=args.kv_cache_space,
    )
    try:
        vocab = len(llm.get_tokenizer())
        # Like vLLM: random ids below 10000 (ordinary tokens, never special ones at the top).
        rng = np.random.default_rng(args.seed)
        dummy = rng.integers(min(10000, vocab), size=(args.batch_size, args.input_len))
        prompts: list[Any] = [{"prompt_token_ids": row.tolist()} for row in dummy]
        params = SamplingParams(
            n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len
        )

        def run_once() -> float:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        for i in range(args.num_iters_warmup):
            print(f"Warmup iteration {i + 1}/{args.num_iters_warmup}: {run_once():.3f} s")
        latencies = []
        for i in range(args.num_iters):
            latencies.append(run_once())
            print(f"Iteration {i + 1}/{args.num_iters}: {latencies[-1]:.3f} s")
    finally:
        llm.shutdown()
    values = np.percentile(latencies, PERCENTILES)
    print(f"Avg latency: {np.mean(latencies)} seconds")
    for pct, value in zip(PERCENTILES, values):
        print(f"{pct}% percentile latency: {value} seconds")
    write_json(
        args.output_json,
        {
            "args": vars(args),
            "avg_latency": float(np.mean(latencies)),
            "latencies": latencies,
            "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, values)},
            "output_tokens_per_s": args.batch_size * args.output_len / float(np.mean(latencies)),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
