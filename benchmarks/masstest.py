"""Stress run: many requests through one engine in one loop, then strict bookkeeping checks.

    python masstest.py --pipeline_parallel_size 2 --verify --num_prompts 300 --max_tokens 32 \
        --squeeze_kv --abort_frac 0.1

Checks (exit 1 if any fails): every request finishes exactly once; no output for an unknown id
or after a request finished; aborted requests end with finish_reason "abort"; the others end with
"stop"/"length" within max_tokens; afterwards the engine is idle with every KV block free.
`--verify` reruns greedy (and seeded random) requests on a separate PP=1 engine and requires
identical token ids. An aborted request that was still queued gets no output from the engine
(vLLM's abort semantics); it is then recorded here as aborted without one.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from benchmarks.common import env_var, load_prompts, load_tokenizer, take_prompts, write_json


@dataclass
class Req:
    rid: str
    prompt: str
    params: Any
    kind: str  # "greedy", "seeded" (random but reproducible) or "random"
    abort_step: int | None = None


@dataclass
class RunState:
    finished: dict[str, Any] = field(default_factory=dict)
    finish_counts: Counter = field(default_factory=Counter)
    aborted: set[str] = field(default_factory=set)
    late_aborts: int = 0  # abort_request on a finished or already aborted request: a no-op
    errors: list[str] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    # Per stage fault, in order: seconds from the kill to the engine's fault event.
    found_after_kill_s: list[float] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="Model (default: bundled SmolLM2).")
    p.add_argument(
        "--num_prompts",
        "--num-prompts",
        type=int,
        default=None,
        help="Requests (default: every prompt of benchmarks/prompts.txt; more are "
        "synthesised by joining prompts).",
    )
    p.add_argument(
        "--max_tokens", "--max-tokens", type=int, default=32, help="max_tokens of every request."
    )
    p.add_argument(
        "--pipeline_parallel_size",
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="Pipeline stages of the engine under test.",
    )
    p.add_argument(
        "--tensor_parallel_size",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="Tensor-parallel ranks per stage of the engine under test.",
    )
    p.add_argument(
        "--max_num_seqs",
        "--max-num-seqs",
        type=int,
        default=256,
        help="Scheduler's max sequences per step.",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="Model dtype of both engines (auto: the model's, fp32 if none).",
    )
    p.add_argument(
        "--kv_cache_space",
        "--kv-cache-space",
        type=float,
        default=4.0,
        help="KV cache GiB per stage (CPU).",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the request mix and engine.")
    p.add_argument(
        "--verify",
        action="store_true",
        help="Compare greedy/seeded token ids with a PP=1 reference engine.",
    )
    p.add_argument(
        "--random_sampling_frac",
        "--random-sampling-frac",
        type=float,
        default=0.0,
        help="Fraction of requests with random temperature/top_p/top_k (half seeded).",
    )
    p.add_argument(
        "--abort_frac",
        "--abort-frac",
        type=float,
        default=0.0,
        help="Fraction of requests aborted after a random number of steps.",
    )
    p.add_argument(
        "--squeeze_kv",
        "--squeeze-kv",
        action="store_true",
        help="Give the engine few KV blocks so preemption happens.",
    )
    p.add_argument(
        "--preemption_mode",
        "--preemption-mode",
        choices=["recompute", "swap"],
        default=None,
        help="How the engine preempts under --squeeze_kv (vLLM's --preemption-mode; default: "
        "recompute for a single sequence). 'swap' moves preempted KV to host memory and "
        "back, so stage faults also meet swapped requests.",
    )
    p.add_argument(
        "--squeeze_blocks",
        "--squeeze-blocks",
        type=int,
        default=None,
        help="Block count under --squeeze_kv (default: ~1/8 of the total demand).",
    )
    p.add_argument(
        "--ref_threads",
        "--ref-threads",
        type=int,
        default=None,
        help="CPU threads of the PP=1 reference (default: the engine's default).",
    )
    p.add_argument(
        "--kill-stage-every",
        "--kill_stage_every",
        dest="kill_stage_every",
        type=float,
        default=None,
        metavar="S",
        help="Fault injection: kill a random stage every S seconds of service during "
        "RUN ALL (the clock restarts after each recovery; needs PP > 1); the "
        "engine must replace it and lose nothing.",
    )
    p.add_argument(
        "--distributed-executor-backend",
        "--distributed_executor_backend",
        dest="distributed_executor_backend",
        default=None,
        choices=["ray", "mp"],
        help="Backend of the engine under test (default: the engine's; the PP=1 reference "
        "runs in-process).",
    )
    p.add_argument(
        "--stage-recovery",
        "--stage_recovery",
        dest="stage_recovery",
        default="local",
        choices=["local", "full", "both"],
        help="How a replaced stage gets its KV back (the engine's --stage-recovery); 'both' "
        "runs the same workload once with each and prints each fault's figures per mode.",
    )
    p.add_argument(
        "--kill-mode",
        "--kill_mode",
        dest="kill_mode",
        default="mixed",
        choices=["mixed", "sigkill", "ray.kill", "sigstop"],
        help="How stages are killed: SIGKILL of the process, ray.kill of the actor, "
        "SIGSTOP (frozen), or each in turn (mixed).",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="Dump all stacks and exit non-zero after this many seconds (hangs).",
    )
    p.add_argument(
        "--corrupt-for-test",
        "--corrupt_for_test",
        dest="corrupt_for_test",
        action="store_true",
        help="Test hook: flip one output token before verification (must fail).",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="Print every output and abort.")
    p.add_argument(
        "--output-json",
        "--output_json",
        dest="output_json",
        default=None,
        help="Write the summary and every failure to this file.",
    )
    args = p.parse_args(argv)
    for name in ("random_sampling_frac", "abort_frac"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name} must be in [0, 1]")
    if args.corrupt_for_test and not args.verify:
        p.error("--corrupt-for-test only makes sense with --verify")
    if args.kill_stage_every is not None and args.pipeline_parallel_size < 2:
        p.error("--kill-stage-every needs --pipeline_parallel_size >= 2 (stages to kill)")
    return args


def build_requests(args: argparse.Namespace, rng: random.Random) -> list[Req]:
    from vllm import SamplingParams

    prompts = load_prompts()
    prompts = take_prompts(prompts, args.num_prompts or len(prompts), seed=args.seed)
    reqs = []
    for i, prompt in enumerate(prompts):
        if rng.random() < args.random_sampling_frac:
            seed = rng.randrange(2**31) if rng.random() < 0.5 else None
            params = SamplingParams(
                temperature=rng.uniform(0.3, 1.5),
                top_p=rng.choice([1.0, 0.9, 0.6]),
                top_k=rng.choice([-1, 5, 40]),
                seed=seed,
                max_tokens=args.max_tokens,
            )
            kind = "random" if seed is None else "seeded"
        else:
            params, kind = SamplingParams(temperature=0.0, max_tokens=args.max_tokens), "greedy"
        reqs.append(Req(str(i), prompt, params, kind))
    # Abort steps spread over the time a request is typically alive: some are still queued,
    # some are running, some inside the pipeline. One that has already finished by then still
    # gets its abort (which must be a no-op), and another unfinished request is aborted instead.
    for req in rng.sample(reqs, round(args.abort_frac * len(reqs))):
        req.abort_step = rng.randint(0, 2 * args.max_tokens)
    return reqs


def squeeze_settings(args: argparse.Namespace, reqs: list[Req]) -> dict[str, int]:
    """A context just big enough for the longest request and a cache far smaller than the
    whole workload needs, so running sequences must be preempted."""
    tokenizer = load_tokenizer(args.model)
    lens = [len(tokenizer.encode(r.prompt)) + args.max_tokens + 1 for r in reqs]
    block = 16  # the engine's default block_size (masstest does not change it)
    max_len = block * math.ceil(max(lens) / block)
    demand = sum(math.ceil(n / block) for n in lens)
    blocks = args.squeeze_blocks or max(2 * max_len // block, demand // 8)
    return {"max_model_len": max_len, "num_gpu_blocks_override": blocks}


def run_all(llm: Any, reqs: list[Req], rng: random.Random, verbose: bool) -> RunState:
    """Add every request, then step until the engine is idle, applying the planned aborts."""
    engine, state = llm.llm_engine, RunState()
    by_id = {r.rid: r for r in reqs}
    aborts: dict[int, list[str]] = {}
    for r in reqs:
        if r.abort_step is not None:
            aborts.setdefault(r.abort_step, []).append(r.rid)
    # Generous: recompute preemption can redo work, but a step always makes some progress.
    step_limit = 20 * len(reqs) * (max(r.params.max_tokens for r in reqs) + 1) + 1000
    bar = tqdm(total=len(reqs), desc="RUN ALL", dynamic_ncols=True)
    start = time.perf_counter()
    for r in reqs:
        engine.add_request(r.rid, r.prompt, r.params)
    while engine.has_unfinished_requests():
        for rid in aborts.pop(state.steps, []):
            if rid in state.finished or rid in state.aborted:
                engine.abort_request(rid)
                state.late_aborts += 1
                live = sorted(set(by_id) - set(state.finished) - state.aborted, key=int)
                if not live:
                    continue
                rid = rng.choice(live)
            engine.abort_request(rid)
            state.aborted.add(rid)
            if verbose:
                tqdm.write(f"abort {rid} at step {state.steps}")
        outputs = engine.step()
        state.steps += 1
        for out in outputs:
            rid = out.request_id
            if rid not in by_id:
                state.errors.append(f"output for unknown request id {rid!r}")
            elif rid in state.finished:
                state.errors.append(f"request {rid}: output after it finished ({out.finished=})")
            if out.finished:
                state.finish_counts[rid] += 1
                state.finished.setdefault(rid, out)
                bar.update(1)
                if verbose:
                    o = out.outputs[0]
                    kind = by_id[rid].kind if rid in by_id else "?"
                    tqdm.write(
                        f"done {rid} [{kind}] {o.finish_reason} "
                        f"{len(o.token_ids)} tok: {o.text[:60]!r}"
                    )
        if state.steps > step_limit:
            state.errors.append(f"no completion after {state.steps} steps: engine stuck")
            break
    state.seconds = time.perf_counter() - start
    # Queued requests aborted before they ran get no output from the engine: count them now.
    bar.update(len(state.aborted - set(state.finished)))
    bar.close()
    return state


class StageKiller:
    """Kills a random stage every `every` seconds of service while the engine runs (one
    fault at a time: the clock restarts when the engine has replaced the last victim)."""

    def __init__(self, llm: Any, every: float, mode: str, seed: int) -> None:
        self.llm, self.every, self.mode = llm, every, mode
        self.rng = random.Random(seed)
        self.kills: list[tuple[int, str, int]] = []  # (rank, how, pid)
        self.kill_times: list[float] = []  # time.time() of each kill
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StageKiller:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        engine = self.llm.llm_engine
        modes = ["sigkill", "ray.kill", "sigstop"]
        while True:
            # One fault at a time, S seconds of service after the engine recovered from the
            # last one (a restart under load can take longer than S).
            while len(engine.fault_events) < len(self.kills) or (
                engine.fault_events and engine.fault_events[-1].recovery_s is None
            ):
                if self._stop.wait(0.05) or engine.is_dead:
                    return
            if self._stop.wait(self.every):
                return
            executor = engine.executor
            infos = engine.get_stage_infos()
            rank = self.rng.randrange(len(infos))
            how = modes[len(self.kills) % 3] if self.mode == "mixed" else self.mode
            if how == "ray.kill" and not hasattr(executor, "workers"):
                how = "sigkill"  # mp: no actors, the process itself
            pid = infos[rank].pid
            if how == "ray.kill":
                import ray

                ray.kill(executor.workers[rank])
            else:
                os.kill(pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
            self.kill_times.append(time.time())
            self.kills.append((rank, how, pid))
            tqdm.write(f"fault injection: {how} of stage {rank} (pid {pid})")


def check(llm: Any, reqs: list[Req], state: RunState) -> list[str]:
    errors = list(state.errors)
    for r in reqs:
        count, out = state.finish_counts[r.rid], state.finished.get(r.rid)
        if r.rid in state.aborted:
            if count > 1:
                errors.append(f"aborted request {r.rid} finished {count} times")
            if out is not None and out.outputs[0].finish_reason != "abort":
                errors.append(
                    f"aborted request {r.rid}: finish_reason "
                    f"{out.outputs[0].finish_reason!r}, expected 'abort'"
                )
            continue
        if count != 1:
            errors.append(f"request {r.rid} finished {count} times (expected exactly once)")
            continue
        o = out.outputs[0]
        if o.finish_reason not in ("stop", "length"):
            errors.append(f"request {r.rid}: unexpected finish_reason {o.finish_reason!r}")
        if len(o.token_ids) > r.params.max_tokens:
            errors.append(f"request {r.rid}: {len(o.token_ids)} tokens > max_tokens")
        if o.finish_reason == "length" and len(o.token_ids) < r.params.max_tokens:
            errors.append(f"request {r.rid}: 'length' after only {len(o.token_ids)} tokens")
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        errors.append("engine still has unfinished requests after the loop")
    sched = engine.scheduler
    free, total = sched.block_manager.get_num_free_gpu_blocks(), engine.cache_config.num_gpu_blocks
    if free != total:
        errors.append(f"KV blocks leaked: {free} of {total} free after the run")
    if getattr(sched, "in_flight", None):
        errors.append(f"scheduler still marks {len(sched.in_flight)} requests in flight")
    return errors


def verify(
    args: argparse.Namespace, reqs: list[Req], state: RunState, engine_kwargs: dict[str, Any]
) -> tuple[list[str], int]:
    """Greedy and seeded requests that were not aborted, rerun at PP=1 without squeezing."""
    from vllm import LLM

    todo = [r for r in reqs if r.kind != "random" and r.rid not in state.aborted]
    got = {
        r.rid: list(state.finished[r.rid].outputs[0].token_ids)
        for r in todo
        if r.rid in state.finished
    }
    if args.corrupt_for_test:
        victim = next((rid for rid, ids in got.items() if ids), None)
        if victim is None:
            return ["--corrupt-for-test: no output token to corrupt"], 0
        got[victim][0] += 1
        print(f"--corrupt-for-test: flipped the first token of request {victim}")
    kwargs = {k: v for k, v in engine_kwargs.items() if k != "num_gpu_blocks_override"}
    # The thread count is read when the worker starts: only construction needs the override.
    with env_var("VLLM_CPU_THREADS_PER_STAGE", str(args.ref_threads) if args.ref_threads else None):
        ref = LLM(**{**kwargs, "pipeline_parallel_size": 1})
    try:
        outs = ref.generate([r.prompt for r in todo], [r.params for r in todo])
    finally:
        ref.shutdown()
    errors = []
    for r, ref_out in zip(todo, outs):
        want, have = list(ref_out.outputs[0].token_ids), got.get(r.rid)
        if have != want:
            pos = next(
                (i for i, (a, b) in enumerate(zip(have or [], want)) if a != b),
                min(len(have or []), len(want)),
            )
            errors.append(
                f"verify: request {r.rid} [{r.kind}] differs from PP=1 at token {pos}: "
                f"{(have or [])[pos : pos + 5]} vs {want[pos : pos + 5]}"
            )
    return errors, len(todo)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    rng = random.Random(args.seed)
    reqs = build_requests(args, rng)
    engine_kwargs: dict[str, Any] = dict(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        kv_cache_space=args.kv_cache_space,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if args.preemption_mode is not None:
        engine_kwargs["preemption_mode"] = args.preemption_mode
    if args.squeeze_kv:
        engine_kwargs.update(squeeze_settings(args, reqs))
        print(f"--squeeze_kv: {engine_kwargs}")
    modes = ["local", "full"] if args.stage_recovery == "both" else [args.stage_recovery]
    runs = []
    for mode in modes:
        if len(modes) > 1:
            print(f"\n##### --stage-recovery {mode} #####")
        rng = random.Random(args.seed)
        reqs = build_requests(args, rng)
        runs.append((mode, reqs, *run_engine(args, reqs, rng, engine_kwargs, mode)))
    summary: dict[str, Any] = {}
    errors: list[str] = []
    for mode, reqs, state, faults, run_errors, preemptions, num_blocks in runs:
        verified = 0
        if args.verify:
            verify_errors, verified = verify(args, reqs, state, engine_kwargs)
            run_errors += verify_errors
        run_summary = summarize(args, reqs, state, faults, run_errors, preemptions, num_blocks)
        run_summary["verified"] = verified
        if len(modes) > 1:
            summary.update({f"{mode}.{key}": value for key, value in run_summary.items()})
            errors += [f"[{mode}] {err}" for err in run_errors]
        else:
            summary, errors = run_summary, run_errors
        print(f"\nRUN ALL ({mode}): {state.seconds:.2f} s")
    print("=== masstest summary ===")
    for key, value in summary.items():
        print(f"  {key}: {value:.2f}" if isinstance(value, float) else f"  {key}: {value}")
    print("".join(f"FAIL: {err}\n" for err in errors[:20]), end="")
    print(f"... and {len(errors) - 20} more failures" if len(errors) > 20 else "", end="")
    write_json(args.output_json, {"args": vars(args), "summary": summary, "errors": errors})
    print("masstest: PASS" if not errors else f"masstest: FAIL ({len(errors)} problems)")
    return 0 if not errors else 1


def run_engine(
    args: argparse.Namespace,
    reqs: list[Req],
    rng: random.Random,
    engine_kwargs: dict[str, Any],
    mode: str,
) -> tuple[RunState, list[Any], list[str], int, int]:
    """RUN ALL on an engine recovering with `mode`, killing stages if asked: (state, fault
    events, errors, preemptions, device blocks)."""
    from vllm import LLM

    kwargs = dict(engine_kwargs, stage_recovery=mode)
    if args.distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = args.distributed_executor_backend
    if args.kill_stage_every is not None:
        # Every injected fault must be survived: no restart limit for the stress run.
        kwargs["max_stage_restarts"] = 1_000_000
    llm = LLM(pipeline_parallel_size=args.pipeline_parallel_size, **kwargs)
    faults: list[Any] = []
    try:
        if args.kill_stage_every is not None:
            with StageKiller(llm, args.kill_stage_every, args.kill_mode, args.seed) as killer:
                state = run_all(llm, reqs, rng, args.verbose)
            faults = llm.llm_engine.fault_events
            print(f"\n=== {len(killer.kills)} stages killed, {len(faults)} failures handled ===")
            for (rank, how, pid), killed_at, event in zip(killer.kills, killer.kill_times, faults):
                # From the kill to the engine's fault event (not the failed wait's length).
                state.found_after_kill_s.append(event.detected_at - killed_at)
                print(
                    f"  [{mode}] {how:8s} stage {rank} (pid {pid}): detected "
                    f"{state.found_after_kill_s[-1]:.2f} s after the kill, recovered in "
                    f"{event.recovery_s or float('nan'):.2f} s "
                    f"(replay {event.replay_s:.2f} s), every request back: "
                    f"{_back(event.caught_up_s)}, "
                    f"{event.recomputed_token_stages} token-stages recomputed "
                    f"(full path for this state: {event.full_path_token_stages}; "
                    f"{event.replayed_tokens} tokens replayed, "
                    f"{len(event.recomputed_requests)} requests in full), "
                    f"recovery {event.stage_recovery}"
                )
        else:
            state = run_all(llm, reqs, rng, args.verbose)
        errors = check(llm, reqs, state)
        if len(faults) != (len(killer.kills) if args.kill_stage_every is not None else 0):
            errors.append(f"{len(killer.kills)} stages killed but {len(faults)} failures seen")
        preemptions = llm.llm_engine.scheduler.num_cumulative_preemption
        num_blocks = llm.llm_engine.cache_config.num_gpu_blocks
    finally:
        llm.shutdown()  # before the reference engine starts: one engine at a time
    return state, faults, errors, preemptions, num_blocks


def summarize(
    args: argparse.Namespace,
    reqs: list[Req],
    state: RunState,
    faults: list[Any],
    errors: list[str],
    preemptions: int,
    num_blocks: int,
) -> dict[str, Any]:
    """The run's figures (requests, tokens, throughput, faults and their recovery work)."""
    outs = [o.outputs[0] for o in state.finished.values()]
    in_toks = sum(len(o.prompt_token_ids) for o in state.finished.values())  # ran ones
    out_toks = sum(len(o.token_ids) for o in outs)
    reported = sum(1 for rid in state.aborted if rid in state.finished)
    caught_up = [f.caught_up_s for f in faults if f.caught_up_s is not None]
    summary = {
        "requests": len(reqs),
        "kinds": dict(Counter(r.kind for r in reqs)),
        "finished": len(state.finished) - reported,
        "aborted": len(state.aborted),
        "aborts_reported_by_engine": reported,
        "noop_aborts": state.late_aborts,
        "finish_reasons": dict(Counter(o.finish_reason for o in outs)),
        "prompt_tokens": in_toks,
        "output_tokens": out_toks,
        "preemptions": preemptions,
        "gpu_blocks": num_blocks,
        "steps": state.steps,
        "run_all_seconds": state.seconds,
        "output_tokens_per_s": out_toks / state.seconds,
        "requests_per_s": len(reqs) / state.seconds,
        "stage_faults": len(faults),
        "max_detection_s": max(
            state.found_after_kill_s or [f.detected_after_s for f in faults], default=0.0
        ),
        "max_recovery_s": max((f.recovery_s or 0.0 for f in faults), default=0.0),
        # Detection to every request back where it was, over the faults where that happened
        # before the next one.
        "median_caught_up_s": statistics.median(caught_up) if caught_up else None,
        "faults_caught_up": len(caught_up),
        "recomputed_token_stages": sum(f.recomputed_token_stages for f in faults),
        "full_path_token_stages": sum(f.full_path_token_stages for f in faults),
        # The largest share of its full path one fault recomputed (issue target: 1/PP).
        "max_fault_share": max(
            (
                f.recomputed_token_stages / f.full_path_token_stages
                for f in faults
                if f.full_path_token_stages
            ),
            default=None,
        ),
        "errors": len(errors),
    }
    return summary


def _back(caught_up_s: float | None) -> str:
    if caught_up_s is None:
        return "not before the next fault"
    return f"{caught_up_s:.2f} s after detection"


if __name__ == "__main__":
    raise SystemExit(main())
