"""The automatic layer re-split (`--pp-auto-rebalance`) against a stage slowed on purpose.

    python -m benchmarks.pp_rebalance                    # PP=2 (mp), stage 1 slowed
    python -m benchmarks.pp_rebalance --slow-stage 0 --num-prompts 8 --output-len 48

One engine (mp backend, one thread per stage, the even split). Each stage process is pinned
to a core of its own; the slowed stage shares its core with --spinners spinning child
processes (busy loops pinned there too) and runs at a lower priority (--nice), so it gets a
fraction of its core whatever else the machine runs. Then the same greedy workload runs:
  before  the even split, automatic re-split held off;
  adapt   the automatic re-split on, until it re-splits (it reads the stages' compute times
          every few seconds and moves layers off the slow stage when the predicted step time
          gains at least --min-gain);
  after   the new split, re-split held off again.
Printed: the split, generated tokens/s, the mean engine step time and each stage's compute
time per step for `before` and `after`, what the re-split predicted, and whether the outputs
of `after` equal those of `before` (greedy: they must).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from typing import Any

from benchmarks.common import (
    environment,
    load_prompts,
    print_table,
    take_prompts,
    write_json,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="Model (default: bundled SmolLM2).")
    p.add_argument("--pp", type=int, default=2, help="Pipeline stages.")
    p.add_argument("--slow-stage", type=int, default=1, help="The stage to slow down.")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--spinners", type=int, default=1, help="Busy loops sharing the slowed stage's core."
    )
    p.add_argument(
        "--nice",
        type=int,
        default=5,
        help="Niceness of the slowed stage: on a machine busy with other work it would "
        "otherwise get as large a share of its core as the other stage gets of its own.",
    )
    p.add_argument("--min-gain", type=float, default=0.1, help="--pp-rebalance-min-gain.")
    p.add_argument(
        "--interval-s", type=float, default=2.0, help="How often the stage times are read."
    )
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def _spin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


def pin(pid: int, cores: set[int], nice: int = 0) -> None:
    """Pin every thread of process `pid` to `cores`, at niceness `nice` (per thread on
    Linux)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cores)
            os.setpriority(os.PRIO_PROCESS, int(task), nice)
        except OSError:  # a thread that just ended
            pass


def run_phase(llm: Any, prompts: list[str], params: Any) -> tuple[dict[str, Any], list[Any]]:
    """One pass of the workload: tokens/s, engine step time, stage compute per step."""
    engine = llm.llm_engine
    engine.get_stage_stats(reset=True)
    steps = engine.num_steps
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    stats = engine.get_stage_stats(reset=True)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_steps = engine.num_steps - steps
    return {
        "split": engine.resilience.reshaper.current_split(),
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "engine_steps": num_steps,
        "step_ms": 1000 * wall / max(num_steps, 1),
        "stage_compute_ms_per_step": [
            1000 * s.compute_s / max(s.steps, 1) for s in sorted(stats, key=lambda s: s.pp_rank)
        ],
    }, [list(o.outputs[0].token_ids) for o in outputs]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < args.pp:
        raise SystemExit(f"needs {args.pp} cores (one per stage), this process has {cores}")
    os.environ.setdefault("VLLM_CPU_THREADS_PER_STAGE", "1")
    # A stage starved on purpose answers its heartbeats late: not a frozen stage here.
    os.environ.setdefault("VLLM_PP_HEARTBEAT_TIMEOUT_S", "30")
    from vllm import LLM, SamplingParams
    from vllm.resilience.plans import reshape

    reshape.AUTO_INTERVAL_S = args.interval_s
    llm = LLM(
        args.model,
        pipeline_parallel_size=args.pp,
        distributed_executor_backend="mp",
        pp_auto_rebalance=True,
        pp_rebalance_min_gain=args.min_gain,
        disable_log_stats=True,
    )
    engine = llm.llm_engine
    reshaper = engine.resilience.reshaper
    reshaper.auto = False

    def pin_stages() -> None:
        # Again before each phase: a stage replaced meanwhile is a new process.
        for info in engine.get_stage_infos():
            assert info.pid is not None
            nice = args.nice if info.pp_rank == args.slow_stage else 0
            pin(info.pid, {cores[info.pp_rank % len(cores)]}, nice)

    pin_stages()
    slow_core = cores[args.slow_stage % len(cores)]
    spawn = multiprocessing.get_context("spawn")
    spinners = [
        spawn.Process(target=_spin, args=(slow_core,), daemon=True) for _ in range(args.spinners)
    ]
    for spinner in spinners:
        spinner.start()
    prompts = take_prompts(load_prompts(), args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    try:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        pin_stages()
        before, before_ids = run_phase(llm, prompts, params)
        reshaper.auto = True
        for _ in range(5):
            pin_stages()
            run_phase(llm, prompts, params)
            if reshaper.events:
                break
        reshaper.auto = False
        event = reshaper.events[-1] if reshaper.events else None
        pin_stages()
        after, after_ids = run_phase(llm, prompts, params)
        faults = len(engine.fault_events)
    finally:
        for spinner in spinners:
            spinner.kill()
        llm.shutdown()
    rows = []
    for name, phase in (("before", before), ("after", after)):
        rows.append(
            [
                name,
                str(phase["split"]),
                f"{phase['tokens_per_s']:.1f}",
                f"{phase['step_ms']:.1f}",
                " / ".join(f"{t:.1f}" for t in phase["stage_compute_ms_per_step"]),
            ]
        )
    print(
        f"\nPP={args.pp} (mp), stage {args.slow_stage} shares core {slow_core} with "
        f"{args.spinners} busy loop(s), at nice {args.nice}"
    )
    print_table(["phase", "split", "tokens/s", "step ms", "stage compute ms/step"], rows)
    if event is None:
        print("no automatic re-split happened")
    else:
        print(
            f"auto re-split {event.old_split} -> {event.new_split} in {event.seconds:.2f} s: "
            f"step {1000 * (event.measured_step_s or 0):.1f} ms -> "
            f"{1000 * (event.predicted_step_s or 0):.1f} ms predicted"
        )
    print(f"step time after / before: {after['step_ms'] / before['step_ms']:.2f}")
    if faults:
        print(f"WARNING: {faults} stage failure(s) during the run: the figures include them")
    print(f"outputs after == before (greedy): {after_ids == before_ids}")
    write_json(
        args.output_json,
        {
            "args": vars(args),
            "env": environment(),
            "before": before,
            "after": after,
            "event": event.as_dict() if event is not None else None,
            "outputs_equal": after_ids == before_ids,
        },
    )


if __name__ == "__main__":
    main()
