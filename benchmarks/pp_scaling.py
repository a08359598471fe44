"""Pipeline-parallel scaling on CPU: does splitting the layers over N single-threaded stages beat
one stage with N threads, and how close does it get to N x one thread?

    python -m benchmarks.pp_scaling                # PP=2 on the default workload
    python -m benchmarks.pp_scaling --also-pp 4    # add a PP=4 row
    python -m benchmarks.pp_scaling --with-tp      # add a TP=N row (N single-threaded ranks)
    python -m benchmarks.pp_scaling --compare-sync # add PP=N without async scheduling

The same workload (--num-prompts prompts of benchmarks/prompts.txt, --output-len new tokens
each, greedy, `ignore_eos`) runs in a fresh subprocess per configuration, so a thread setting
cannot leak from one run into the next:
  (a) PP=1, 1 thread   (b) PP=1, N threads   (c) PP=N, 1 thread per stage   [(d) PP=M, ...]
  [(e) TP=N, 1 thread per rank]  [(f) PP=N with async scheduling off]
and prints generated tokens/s and wall time per configuration plus
  efficiency = tput(config) / (ranks x tput(PP=1, 1 thread)),
each stage's idle share (waiting for the engine between steps), and, for PP > 1, the bytes
of the step messages per step (deltas) next to what full token histories would take (both
counted on a second pass of the same workload, so the timed pass pays no pickling).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO_ROOT,
    fmt_bytes,
    load_prompts,
    print_table,
    take_prompts,
    write_json,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--pp",
        type=int,
        default=2,
        help="N: stages of the PP run (and threads of the multi-threaded PP=1 run).",
    )
    p.add_argument(
        "--also-pp",
        type=int,
        action="append",
        default=[],
        help="Extra PP sizes to run at 1 thread per stage (repeatable).",
    )
    p.add_argument("--model", default="smollm2", help="Model (default: bundled SmolLM2).")
    p.add_argument("--num-prompts", type=int, default=64, help="Requests per run.")
    p.add_argument("--output-len", type=int, default=128, help="New tokens per request.")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="Model dtype (auto: the model's, fp32 if none).",
    )
    p.add_argument("--kv-cache-space", type=float, default=4.0, help="KV GiB per stage (CPU).")
    p.add_argument(
        "--pp-layer-partition",
        default=None,
        help="Layer split for the PP>1 runs: 'a,b,...' or 'auto' (default: even).",
    )
    p.add_argument(
        "--compare-sync",
        action="store_true",
        help="Also run PP=N with async scheduling off (the synchronous pipeline).",
    )
    p.add_argument(
        "--with-tp",
        action="store_true",
        help="Also run TP=N (one stage, N single-threaded tensor-parallel ranks).",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=["ray", "mp"],
        help="Executor of the multi-rank runs (default: the engine's, Ray if installed).",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="Rounds over all configurations (interleaved); each keeps its best.",
    )
    p.add_argument("--timeout", type=float, default=1800, help="Seconds allowed per config.")
    p.add_argument("--output-json", default=None, help="Write every figure to this file.")
    # Internal: run one configuration in this (fresh) process and write its result here.
    p.add_argument("--worker-result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-pp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--worker-tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--worker-sync", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_worker(args: argparse.Namespace) -> None:
    """One configuration, measured in this process; threads come from the environment."""
    from vllm import LLM, SamplingParams

    prompts = take_prompts(load_prompts(), args.num_prompts)
    start = time.perf_counter()
    partition = args.pp_layer_partition if args.worker_pp > 1 else None
    multi = args.worker_pp * args.worker_tp > 1
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        pipeline_parallel_size=args.worker_pp,
        tensor_parallel_size=args.worker_tp,
        kv_cache_space=args.kv_cache_space,
        pp_layer_partition=partition,
        async_scheduling=False if args.worker_sync else None,
        distributed_executor_backend=args.backend if multi else None,
    )
    init_s = time.perf_counter() - start
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        load_before = os.getloadavg()[0]
        llm.llm_engine.get_stage_stats(reset=True)
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        driver_cpu = time.process_time() - cpu_start
        stage_stats = [st.as_dict() for st in llm.llm_engine.get_stage_stats()]
        infos = llm.llm_engine.get_stage_infos()
        peaks = [m["peak_rss_bytes"] for m in llm.llm_engine.executor.get_stage_memory()]
        blocks = llm.llm_engine.cache_config.num_gpu_blocks
        queue = llm.llm_engine.batch_queue
        ahead = queue.reset_stats().ahead_groups
        bytes_stats = None
        if args.worker_pp > 1:
            # Second, untimed pass of the same workload to count the step messages' bytes.
            queue.count_bytes = True
            llm.generate(prompts, params, use_tqdm=False)
            st = queue.reset_stats()
            bytes_stats = {
                "steps": st.steps,
                "step_bytes": st.step_bytes,
                "full_bytes": st.full_bytes,
                "max_step_bytes": max(st.per_step_bytes, default=0),
            }
    finally:
        llm.shutdown()
    out_toks = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_toks = sum(len(o.prompt_token_ids) for o in outputs)
    result = {
        "pp": args.worker_pp,
        "tp": args.worker_tp,
        "backend": llm.llm_engine.parallel_config.distributed_executor_backend,
        "threads_per_stage": [i.threads for i in infos],
        "layers_per_stage": [i.layers[1] - i.layers[0] for i in infos if i.layers],
        "init_s": init_s,
        "wall_s": wall,
        "prompt_tokens": in_toks,
        "output_tokens": out_toks,
        "generated_tokens_per_s": out_toks / wall,
        "total_tokens_per_s": (in_toks + out_toks) / wall,
        "num_gpu_blocks": blocks,
        "peak_rss_bytes_per_stage": peaks,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg()[0],
        "driver_cpu_s": driver_cpu,
        "stage_stats": stage_stats,
        "async_scheduling": queue.async_pipeline,
        "ahead_groups": ahead,
        "message_bytes": bytes_stats,
    }
    Path(args.worker_result).write_text(json.dumps(result))


def run_config(
    args: argparse.Namespace,
    label: str,
    pp: int,
    threads: int,
    tp: int = 1,
    sync: bool = False,
) -> dict[str, Any]:
    """Start this script in worker mode with the thread count in its environment."""
    env = dict(os.environ, VLLM_CPU_THREADS_PER_STAGE=str(threads), OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.pp_scaling",
            "--worker-result",
            result_file,
            "--worker-pp",
            str(pp),
            "--worker-tp",
            str(tp),
            *(["--worker-sync"] if sync else []),
            "--model",
            args.model,
            "--num-prompts",
            str(args.num_prompts),
            "--output-len",
            str(args.output_len),
            "--dtype",
            args.dtype,
            "--kv-cache-space",
            str(args.kv_cache_space),
        ]
        if args.pp_layer_partition:
            cmd += ["--pp-layer-partition", args.pp_layer_partition]
        if args.backend:
            cmd += ["--backend", args.backend]
        print(
            f"\n--- {label}: VLLM_CPU_THREADS_PER_STAGE={threads} {' '.join(cmd[1:])}", flush=True
        )
        proc = subprocess.run(cmd, env=env, timeout=args.timeout)
        if proc.returncode != 0 or not os.path.exists(result_file):
            raise SystemExit(f"{label} failed with exit code {proc.returncode}")
        result = json.loads(Path(result_file).read_text())
    result["label"] = label
    print(
        f"--- {label}: {result['generated_tokens_per_s']:.2f} generated tok/s, "
        f"{result['wall_s']:.2f} s",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_result:
        run_worker(args)
        return 0
    n = args.pp
    configs = [
        ("PP=1, 1 thread", 1, 1),
        (f"PP=1, {n} threads", 1, n),
        (f"PP={n}, 1 thread/stage", n, 1),
    ]
    configs += [(f"PP={m}, 1 thread/stage", m, 1) for m in args.also_pp if m != n]
    if args.with_tp:
        configs.append((f"TP={n}, 1 thread/rank", 1, 1, n))
    if args.compare_sync:
        configs.append((f"PP={n}, sync (no async sched.)", n, 1, 1, True))
    # --repeat: the configurations run in rounds (interleaved), each keeping its best run, so
    # a shared machine's load swings hit every configuration alike.
    runs: list[list[dict[str, Any]]] = [[] for _ in configs]
    for _ in range(args.repeat):
        for i, config in enumerate(configs):
            runs[i].append(run_config(args, *config))
    results = [max(r, key=lambda x: x["generated_tokens_per_s"]) for r in runs]
    for result, all_runs in zip(results, runs):
        result["all_generated_tokens_per_s"] = [x["generated_tokens_per_s"] for x in all_runs]
    base = results[0]["generated_tokens_per_s"]
    multi = results[1]["generated_tokens_per_s"]
    print(
        f"\n=== PP scaling: {args.num_prompts} prompts x {args.output_len} new tokens, "
        f"model {args.model}, {os.cpu_count()} CPUs ==="
    )
    rows = []
    for r in results:
        ranks = r["pp"] * r.get("tp", 1)
        r["efficiency"] = r["generated_tokens_per_s"] / (ranks * base) if ranks > 1 else None
        split = "/".join(str(n) for n in r.get("layers_per_stage", []))
        rows.append(
            [
                f"{r['label']} [{split}]",
                f"{r['generated_tokens_per_s']:.2f}",
                f"{r['wall_s']:.2f}",
                f"{r['generated_tokens_per_s'] / base:.2f}x",
                f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-",
                r["num_gpu_blocks"],
                " / ".join(fmt_bytes(b) for b in r["peak_rss_bytes_per_stage"]),
                f"{r['load_avg_before']:.1f}",
                " ".join(f"{t:.0f}" for t in r["all_generated_tokens_per_s"]),
            ]
        )
    print_table(
        [
            "config",
            "gen tok/s",
            "wall s",
            "vs (a)",
            "efficiency",
            "GPU blocks",
            "peak RSS per rank",
            "load",
            "all runs",
        ],
        rows,
    )
    print(
        "\nWhere the time went (seconds per stage: compute / waiting to receive / send / "
        "idle between steps / cache ops / waiting for sampled ids; driver = engine process "
        "CPU time):"
    )
    for r in results:
        parts = [
            f"rank {i} (stage {int(st['pp_rank'])}): {st['compute_s']:.1f} "
            f"(cpu {st.get('compute_cpu_s', 0):.1f}) / {st['recv_s']:.1f} / "
            f"{st['send_s']:.1f} / {st['idle_s']:.1f} / {st.get('cache_s', 0):.1f} / "
            f"{st.get('tokens_wait_s', 0):.1f}"
            for i, st in enumerate(r["stage_stats"])
        ]
        print(f"  {r['label']}: " + "; ".join(parts) + f"; driver CPU {r['driver_cpu_s']:.1f}")
    print(
        "\nStage idle (between steps waiting for the engine, or for sampled ids) as a share of "
        "wall time, and "
        "step-message bytes per step (deltas vs full token histories):"
    )
    for r in results:
        # Idle: between steps (waiting for the engine) plus, on the first stage with async
        # scheduling, waiting for the last stage's sampled ids.
        idle = " / ".join(
            f"{100 * (st['idle_s'] + st.get('tokens_wait_s', 0)) / r['wall_s']:.1f}%"
            for st in r["stage_stats"]
        )
        line = f"  {r['label']}: idle {idle}"
        mb = r.get("message_bytes")
        if mb and mb["steps"]:
            line += (
                f"; {mb['step_bytes'] / mb['steps']:.0f} B/step (max {mb['max_step_bytes']})"
                f" vs {mb['full_bytes'] / mb['steps']:.0f} B/step with full histories "
                f"({mb['full_bytes'] / max(1, mb['step_bytes']):.1f}x)"
            )
        first = r["stage_stats"][0]
        if first.get("step_bytes") and first["steps"]:
            line += f"; stage 0 received {first['step_bytes'] / first['steps']:.0f} B/step (timed)"
        if r.get("async_scheduling"):
            line += f"; {r['ahead_groups']} group-steps scheduled ahead"
        print(line)
    pp_run = results[2]
    print(
        f"pipeline efficiency = tput(PP={n}) / ({n} x tput(PP=1, 1 thread)) = "
        f"{pp_run['generated_tokens_per_s']:.2f} / ({n} x {base:.2f}) = "
        f"{pp_run['efficiency']:.3f}"
    )
    print(
        f"PP={n} (1 thread/stage) vs PP=1 ({n} threads): "
        f"{pp_run['generated_tokens_per_s'] / multi:.2f}x"
    )
    for r in results:
        if r.get("tp", 1) > 1:
            tput = r["generated_tokens_per_s"]
            print(
                f"{r['label']} ({r['backend']}): {tput / multi:.2f}x PP=1 ({n} threads), "
                f"{tput / pp_run['generated_tokens_per_s']:.2f}x PP={n}; "
                f"efficiency {r['efficiency']:.3f}"
            )
    write_json(args.output_json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
