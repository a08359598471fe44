"""Heartbeat round trips of busy stages on a loaded machine: the figures behind the default of
VLLM_PP_HEARTBEAT_TIMEOUT_S (a healthy stage must never stay silent that long).

    python -m benchmarks.heartbeat_jitter [--backend mp] [-pp 4] [--load 2] [--seconds 60]

`--load` processes spin on the CPU the whole time (as CI's other jobs do on a 2-core machine),
while the engine serves batches of long prompts (long prefill steps) and decodes. Prints, per
rank, the heartbeat round trips (p50, p99, max) measured by the engine's supervisor while the
heartbeat timeout applied, the longest step, and how many stages were declared failed (must
be 0: any is a false positive).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from typing import Any

from benchmarks.common import load_tokenizer, print_table, synthetic_token_prompts, write_json


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--backend", choices=["mp", "ray"], default="mp")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=4)
    p.add_argument("--load", type=int, default=os.cpu_count() or 1, help="spinning processes")
    p.add_argument("--seconds", type=float, default=60.0, help="serve for this long")
    p.add_argument("--prompt-tokens", type=int, default=1500, help="tokens of each prompt")
    p.add_argument("--batch", type=int, default=8, help="prompts per generate call")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    from vllm import LLM, SamplingParams

    ctx = multiprocessing.get_context("spawn")
    spinners = [ctx.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for proc in spinners:
        proc.start()
    try:
        llm = LLM(
            args.model,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.backend,
            max_model_len=2048,
            disable_log_stats=True,
        )
        prompts = synthetic_token_prompts(
            load_tokenizer(args.model), args.batch, args.prompt_tokens
        )
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        engine = llm.llm_engine
        longest_call = 0.0
        calls = 0
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            started = time.monotonic()
            llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
            longest_call = max(longest_call, time.monotonic() - started)
            calls += 1
        stats = engine.executor.heartbeat_stats()
        faults = len(engine.fault_events)
        llm.shutdown()
    finally:
        for proc in spinners:
            proc.kill()
    rows = [
        [s.rank, s.answered, f"{s.p50_s * 1e3:.1f}", f"{s.p99_s * 1e3:.1f}", f"{s.max_s * 1e3:.1f}"]
        for s in stats
    ]
    print(
        f"{args.backend} PP={args.pipeline_parallel_size}, {args.load} spinning processes on "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}: {calls} batches of "
        f"{args.batch} x {args.prompt_tokens}-token prompts, longest batch {longest_call:.1f} s"
    )
    print_table(["rank", "answers", "p50 ms", "p99 ms", "max ms"], rows)
    worst = max((s.max_s for s in stats), default=0.0)
    print(f"worst round trip {worst * 1e3:.0f} ms; stages declared failed: {faults}")
    result = {
        "backend": args.backend,
        "pp": args.pipeline_parallel_size,
        "load": args.load,
        "longest_batch_s": longest_call,
        "per_rank": [vars(s) for s in stats],
        "worst_rtt_s": worst,
        "faults": faults,
    }
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
