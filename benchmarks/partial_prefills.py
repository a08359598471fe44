"""Short prompts queued behind a long one: their time to first token with vLLM's
`max_num_partial_prefills` (several prompts prefilled at once, sharing a step's budget) and
`max_long_partial_prefills` (short prompts may pass a long one), against the default (one
long prompt takes every step's prompt budget until it is done), in one run.

    python -m benchmarks.partial_prefills                       # PP 1 and 2, 2048-token prompt
    python -m benchmarks.partial_prefills --pp-sizes 2 --long-len 4096 --num-short 4

For each pipeline size and each setting (max_num_partial_prefills 1, then `--partial`), one
engine (chunked prefill, `--max-num-batched-tokens` tokens a round) is warmed up, then a
prompt of `--long-len` random token ids and, right behind it, `--num-short` prompts of
`--short-len` tokens are added at once (`max_tokens=1`); every request's time to first token
is taken when its output arrives. Printed: the long prompt's TTFT, the short prompts' mean
TTFT, and the ratios of the setting to the default on the same pipeline (same run).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from benchmarks.common import print_table, random_token_ids, write_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="Model (default: bundled SmolLM2).")
    p.add_argument("--pp-sizes", default="1,2", help="Pipeline sizes, comma-separated.")
    p.add_argument("--backend", default="mp", help="distributed_executor_backend for PP > 1.")
    p.add_argument("--long-len", type=int, default=2048, help="Tokens of the long prompt.")
    p.add_argument("--short-len", type=int, default=32, help="Tokens of each short prompt.")
    p.add_argument("--num-short", type=int, default=3, help="Short prompts behind it.")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="Tokens a round (the chunk)."
    )
    p.add_argument("--partial", type=int, default=2, help="max_num_partial_prefills to try.")
    p.add_argument("--output-json", default=None, help="Write every figure to this file.")
    return p.parse_args(argv)


def run(args: argparse.Namespace, pp: int, partial: int) -> dict[str, Any]:
    """TTFT of the long prompt and of each short prompt behind it, on one engine."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        pipeline_parallel_size=pp,
        distributed_executor_backend=args.backend if pp > 1 else None,
        enable_chunked_prefill=True,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.long_len + 64,
        max_num_partial_prefills=partial,
        max_long_partial_prefills=1,
        max_num_seqs=max(8, args.num_short + 2),
    )
    engine = llm.llm_engine
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    try:
        llm.generate([{"prompt_token_ids": random_token_ids(256, 0)}], one, use_tqdm=False)
        threshold = engine.scheduler.scheduler_config.long_prefill_token_threshold
        start = time.perf_counter()
        engine.add_request("long", None, one, prompt_token_ids=random_token_ids(args.long_len, 1))
        for i in range(args.num_short):
            engine.add_request(
                f"short{i}", None, one, prompt_token_ids=random_token_ids(args.short_len, i)
            )
        ttft: dict[str, float] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    ttft[output.request_id] = time.perf_counter() - start
    finally:
        llm.shutdown()
    shorts = [ttft[f"short{i}"] for i in range(args.num_short)]
    return {
        "pp": pp,
        "max_num_partial_prefills": partial,
        "long_prefill_token_threshold": threshold,
        "long_ttft_s": ttft["long"],
        "short_ttfts_s": shorts,
        "short_mean_ttft_s": sum(shorts) / len(shorts),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    for pp in [int(x) for x in args.pp_sizes.split(",")]:
        for partial in (1, args.partial):
            r = run(args, pp, partial)
            results.append(r)
            print(
                f"PP={pp} max_num_partial_prefills={partial}: long TTFT {r['long_ttft_s']:.2f} s,"
                f" short mean TTFT {r['short_mean_ttft_s']:.2f} s",
                flush=True,
            )
    print(
        f"\n=== a {args.long_len}-token prompt with {args.num_short} x {args.short_len}-token "
        f"prompts behind it, {args.max_num_batched_tokens} tokens a round, "
        f"max_long_partial_prefills=1, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} ==="
    )
    rows = []
    for r in results:
        base = next(b for b in results if b["pp"] == r["pp"] and b["max_num_partial_prefills"] == 1)
        rows.append(
            [
                r["pp"],
                r["max_num_partial_prefills"],
                r["long_prefill_token_threshold"],
                f"{r['short_mean_ttft_s']:.2f}",
                f"{r['short_mean_ttft_s'] / base['short_mean_ttft_s']:.2f}",
                f"{r['long_ttft_s']:.2f}",
                f"{r['long_ttft_s'] / base['long_ttft_s']:.2f}",
            ]
        )
    print_table(
        [
            "PP",
            "max_num_partial_prefills",
            "threshold",
            "short TTFT s (mean)",
            "vs N=1",
            "long TTFT s",
            "vs N=1",
        ],
        rows,
    )
    write_json(args.output_json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
