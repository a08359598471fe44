"""MoE experts per step: the grouped computation (vllm/model_executor/layers/fused_moe.py)
against a per-token loop and a dense all-experts loop.

A Mixtral-shaped MoE layer (8 experts, top-2, renormalised routing), hidden 512 and expert
intermediate 1792 by default, random weights (std 0.05) and random router logits. For each
number of tokens per step: min and median time per call of each path (grouped as written,
grouped with each expert's weights prepacked for oneDNN as the engine runs it on CPU,
per-token loop, dense loop), the per-token and dense times over the grouped one (ratio > 1:
grouped is faster), the prepacking gain, and the largest absolute difference of each output
from the grouped one. Prints a markdown table; ratios are only comparable
within one run (the machine is shared).

    python -m benchmarks.moe [--reps 10] [--tokens 1 16 64 256] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from vllm.model_executor.layers.fused_moe import (
    FusedMoE,
    dense_experts,
    grouped_experts,
    per_token_experts,
    topk_route,
)

Problem = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype) -> Problem:
    """x, w13, w2, routing weights and expert ids for one step of `tokens` tokens."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (0.05 * torch.randn(experts, 2 * inter, hidden, generator=gen)).to(dtype)
    w2 = (0.05 * torch.randn(experts, hidden, inter, generator=gen)).to(dtype)
    weights, ids = topk_route(torch.randn(tokens, experts, generator=gen), top_k, True)
    return x, w13, w2, weights, ids


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


def row(tokens: int, args: argparse.Namespace, dtype: torch.dtype) -> str:
    """One table row: every path on one step of `tokens` tokens."""
    problem = make(tokens, args.hidden, args.intermediate, args.experts, args.top_k, dtype)
    x, w13, w2, weights, ids = problem
    # The grouped path as the engine runs it on CPU: each expert's weights prepacked.
    experts = FusedMoE(args.experts, args.hidden, args.intermediate).to(dtype)
    experts.w13_weight.copy_(w13)
    experts.w2_weight.copy_(w2)
    experts.pack()
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "grouped": lambda: grouped_experts(*problem),
        "packed": lambda: experts(x, weights, ids),
        "per_token": lambda: per_token_experts(*problem),
        "dense": lambda: dense_experts(*problem),
    }
    outs = {name: run() for name, run in runs.items()}
    times = {name: timeit(run, args.reps) for name, run in runs.items()}
    diff = [
        float((outs[name].float() - outs["grouped"].float()).abs().max())
        for name in ("per_token", "dense", "packed")
    ]
    ms = {name: f"{t[0] * 1e3:.2f} / {t[1] * 1e3:.2f}" for name, t in times.items()}
    best = {name: t[0] for name, t in times.items()}
    return (
        f"| {tokens} | {ms['grouped']} | {ms['packed']} | {ms['per_token']} "
        f"| {ms['dense']} | {best['per_token'] / best['grouped']:.1f}x "
        f"| {best['dense'] / best['grouped']:.1f}x "
        f"| {best['grouped'] / best['packed']:.2f}x "
        f"| {diff[0]:.1e}, {diff[1]:.1e}, {diff[2]:.1e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1792)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"E={args.experts} top_k={args.top_k} hidden={args.hidden} "
        f"intermediate={args.intermediate} {args.dtype}, {args.threads} thread(s); "
        "ms per call (min / median)"
    )
    print(
        "| tokens | grouped | grouped, prepacked | per-token loop | dense loop "
        "| per-token / grouped | dense / grouped | prepacked / grouped "
        "| max abs diff (per-token, dense, prepacked) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for tokens in args.tokens:
            print(row(tokens, args, dtype), flush=True)


if __name__ == "__main__":
    main()
