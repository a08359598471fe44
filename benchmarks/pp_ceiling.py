"""The pipeline efficiency this machine allows, from the model's matmuls alone.

    python -m benchmarks.pp_ceiling               # PP=2, 64 sequences, bundled SmolLM2
    python -m benchmarks.pp_ceiling --pp 4 --dtype bfloat16

One decode round gives every sequence one token. On one stage with one thread it is every
decoder layer's GEMMs at --num-seqs rows (time T1). With N single-threaded stages each stage
runs its 1/N of the layers once per micro-batch of num_seqs/N rows, all stages at the same
time in separate processes (time T_N, the slowest stage). A pipeline with no overhead at all
(no transfers, no idle, no attention, no sampler) would reach

    efficiency = tput(PP=N) / (N x tput(PP=1, 1 thread)) = T1 / (N x T_N)

so this is the ceiling for benchmarks/pp_scaling.py on this machine: half-size GEMMs are less
efficient, and N busy cores share memory bandwidth, caches and clock boost. Every layer has its
own weights, so they stream from memory as in the real model. The lm_head is left out (the
`auto` split balances it over the stages). Runs interleave (single, concurrent, single, ...)
and the best round of each is kept, so a noisy neighbour biases neither side.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

from benchmarks.common import print_table, resolve, write_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pp", type=int, default=2, help="N: concurrent single-threaded stages.")
    p.add_argument("--model", default="smollm2", help="Model (default: bundled SmolLM2).")
    p.add_argument("--num-seqs", type=int, default=64, help="Sequences per decode round.")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--seconds", type=float, default=3.0, help="Timing per measurement.")
    p.add_argument("--repeats", type=int, default=3, help="Interleaved measurements of each.")
    p.add_argument("--output-json", default=None, help="Write the figures to this file.")
    return p.parse_args(argv)


def _build(shapes: list[tuple[int, int]], num_layers: int, rows: int, dtype: Any) -> Any:
    """A function running `num_layers` layers of `shapes` at `rows` rows, as the engine does."""
    import torch
    from torch import nn

    from vllm.model_executor.layers.linear import PackedLinear, linear_path

    pack = linear_path(torch.device("cpu"), dtype)[0]
    layers = []
    for _ in range(num_layers):
        for out_f, in_f in shapes:
            linear = nn.Linear(in_f, out_f, bias=False, dtype=dtype)
            layers.append(PackedLinear(linear) if pack else linear)
    inputs = {in_f: torch.randn(rows, in_f, dtype=dtype) for _, in_f in shapes}

    def run() -> None:
        with torch.inference_mode():
            for layer in layers:
                layer(inputs[layer.in_features])

    run()  # warm-up: oneDNN primitives, page faults
    return run


def _stage(
    num_layers: int,
    micro_batches: int,
    rows: int,
    shapes: list[tuple[int, int]],
    dtype_name: str,
    seconds: float,
    start: Any,
    go: Any,
    results: Any,
    key: int,
) -> None:
    """One process: `micro_batches` passes over `num_layers` layers per round; best round time
    over `seconds`, measured between the two barriers shared with the other stages."""
    import torch

    torch.set_num_threads(1)
    run = _build(shapes, num_layers, rows, getattr(torch, dtype_name))
    start.wait()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(micro_batches):
            run()
        best = min(best, time.perf_counter() - t0)
    results[key] = best
    go.wait()


def _measure(
    n_procs: int,
    num_layers: int,
    micro_batches: int,
    rows: int,
    shapes: list[tuple[int, int]],
    dtype_name: str,
    seconds: float,
) -> list[float]:
    """Best round time of each of `n_procs` concurrent processes."""
    ctx = mp.get_context("spawn")
    start, go = ctx.Barrier(n_procs), ctx.Barrier(n_procs)
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [
            ctx.Process(
                target=_stage,
                args=(
                    num_layers,
                    micro_batches,
                    rows,
                    shapes,
                    dtype_name,
                    seconds,
                    start,
                    go,
                    results,
                    i,
                ),
            )
            for i in range(n_procs)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
            if proc.exitcode != 0:
                raise SystemExit(f"a measuring process failed (exit code {proc.exitcode})")
        return [results[i] for i in range(n_procs)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = resolve(args.model, args.dtype)
    dtype_name = str(config.dtype).removeprefix("torch.")
    shapes, _ = config.get_gemm_shapes()
    num_layers, n = config.get_num_layers(), args.pp
    if num_layers % n or args.num_seqs % n:
        raise SystemExit(f"--pp {n} must divide the layers ({num_layers}) and --num-seqs")
    flops = 2 * args.num_seqs * num_layers * sum(o * i for o, i in shapes)
    singles, stages = [], []
    for _ in range(args.repeats):
        singles.append(
            _measure(1, num_layers, 1, args.num_seqs, shapes, dtype_name, args.seconds)[0]
        )
        stages.append(
            max(
                _measure(
                    n, num_layers // n, n, args.num_seqs // n, shapes, dtype_name, args.seconds
                )
            )
        )
    t1, tn = min(singles), min(stages)
    alone = min(
        _measure(1, num_layers // n, n, args.num_seqs // n, shapes, dtype_name, args.seconds)[0]
        for _ in range(args.repeats)
    )
    print(
        f"\n=== PP ceiling from GEMMs: {config.model}, {dtype_name}, {num_layers} layers, "
        f"{args.num_seqs} sequences, PP={n} ==="
    )
    rows = [
        [
            "PP=1: all layers, 1 micro-batch",
            args.num_seqs,
            f"{t1 * 1e3:.1f}",
            f"{flops / t1 / 1e9:.1f}",
        ],
        [
            f"one stage alone: 1/{n} of layers, {n} micro-batches",
            args.num_seqs // n,
            f"{alone * 1e3:.1f}",
            f"{flops / n / alone / 1e9:.1f}",
        ],
        [
            f"{n} stages at once (slowest)",
            args.num_seqs // n,
            f"{tn * 1e3:.1f}",
            f"{flops / n / tn / 1e9:.1f}",
        ],
    ]
    print_table(["run (1 thread each)", "rows", "ms per round", "GFLOP/s per process"], rows)
    smaller = t1 / (n * alone)
    ceiling = t1 / (n * tn)
    print(f"smaller micro-batches alone: T1 / ({n} x T_stage_alone) = {smaller:.3f}")
    print(f"pipeline efficiency ceiling: T1 / ({n} x T_{n}) = {ceiling:.3f}")
    write_json(
        args.output_json,
        {
            "args": vars(args),
            "t1_s": t1,
            "stage_alone_s": alone,
            "stages_concurrent_s": tn,
            "efficiency_ceiling": ceiling,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
