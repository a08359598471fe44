"""One long prompt through the pipeline: time to first token at PP 1, 2, 3, 4 (one thread per
stage), with chunked pipelining (several chunks of the prompt in flight, on different stages)
and without it (one chunk at a time), with chunks sized by cost (`VLLM_PP_DYNAMIC_CHUNKS`,
shrinking along the prompt) and of a fixed size, in one run.

    python -m benchmarks.long_prompt                           # 4096 tokens, PP 1 and 2
    python -m benchmarks.long_prompt --pp-sizes 1,2,3,4 --prompt-lens 4096,16384
    python -m benchmarks.long_prompt --decodes 32              # 32 requests decode meanwhile

For each prompt length and pipeline size an engine is built (chunked prefill, chunks of
`--max-num-batched-tokens` tokens a round, `VLLM_CPU_THREADS_PER_STAGE=1`), warmed up on a
short prompt, and then times `--rounds` long prompts of random token ids with `max_tokens=1`;
the best round counts. With `--decodes N`, N short requests are decoding when the long prompt
arrives: their decode rate during its prefill is printed too. The ratio column is TTFT at PP=N
over TTFT at PP=1 (same run), PP=1 taking the better of its two chunk sizings; strong-scaling
efficiency is PP=1's TTFT / (N x PP=N's). Stages beyond the machine's cores share them: compare
those rows with that in mind (the header says how many CPUs there are). Prompts longer than the
model's context (SmolLM2: 8192) run with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: the positions past it
give meaningless tokens, but the same work.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from benchmarks.common import env_var, print_table, random_token_ids, write_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="Model (default: bundled SmolLM2).")
    p.add_argument("--quantization", default=None, help="As the engine flag (default: auto).")
    p.add_argument("--pp-sizes", default="1,2", help="Pipeline sizes, comma-separated.")
    p.add_argument("--prompt-lens", default="4096", help="Prompt lengths, comma-separated.")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="Tokens a round (the chunk)."
    )
    p.add_argument("--rounds", type=int, default=2, help="Long prompts timed per engine.")
    p.add_argument("--decodes", type=int, default=0, help="Requests decoding meanwhile.")
    p.add_argument(
        "--backend", default="mp", help="distributed_executor_backend for PP > 1 (mp, ray)."
    )
    p.add_argument("--no-compare", action="store_true", help="Skip the one-chunk-at-a-time runs.")
    p.add_argument(
        "--chunk-sizes",
        choices=("both", "fixed", "by-cost"),
        default="both",
        help="Which chunk sizing to time (both: fixed and by cost, one engine each).",
    )
    p.add_argument("--output-json", default=None, help="Write every figure to this file.")
    return p.parse_args(argv)


def run(
    args: argparse.Namespace, pp: int, length: int, pipelining: bool, dynamic: bool
) -> dict[str, Any]:
    """TTFT of the long prompt (best of the rounds) on one engine."""
    from vllm import LLM, SamplingParams

    with (
        env_var("VLLM_PP_CHUNKED_PIPELINING", "1" if pipelining else "0"),
        env_var("VLLM_PP_DYNAMIC_CHUNKS", "1" if dynamic else "0"),
        env_var("VLLM_CPU_THREADS_PER_STAGE", "1"),
        env_var("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1"),
    ):
        llm = LLM(
            model=args.model,
            quantization=args.quantization,
            pipeline_parallel_size=pp,
            distributed_executor_backend=args.backend if pp > 1 else None,
            enable_chunked_prefill=True,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=length + 64,
            max_num_seqs=max(8, args.decodes + 2),
        )
    engine = llm.llm_engine
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    try:
        llm.generate([{"prompt_token_ids": random_token_ids(256, 0)}], one, use_tqdm=False)
        decoding = []
        if args.decodes:
            params = SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True)
            for i in range(args.decodes):
                engine.add_request(f"d{i}", None, params, prompt_token_ids=random_token_ids(16, i))
                decoding.append(engine.scheduler.waiting[-1])
            while any(g.get_seqs()[0].get_output_len() == 0 for g in decoding):
                engine.step()
        ttfts, rates = [], []
        for r in range(args.rounds):
            before = sum(g.get_seqs()[0].get_output_len() for g in decoding)
            start = time.perf_counter()
            engine.add_request(
                f"long{r}", None, one, prompt_token_ids=random_token_ids(length, r + 1)
            )
            done = False
            while not done:
                done = any(o.request_id == f"long{r}" and o.finished for o in engine.step())
            ttft = time.perf_counter() - start
            ttfts.append(ttft)
            after = sum(g.get_seqs()[0].get_output_len() for g in decoding)
            rates.append((after - before) / ttft)
        engine.abort_request([g.request_id for g in decoding])
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        llm.shutdown()
    best = min(range(len(ttfts)), key=ttfts.__getitem__)
    return {
        "pp": pp,
        "prompt_len": length,
        "pipelining": pipelining,
        "dynamic_chunks": dynamic,
        "ttft_s": ttfts[best],
        "ttfts_s": ttfts,
        "decode_tok_per_s": rates[best] if decoding else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pp_sizes = [int(x) for x in args.pp_sizes.split(",")]
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    results = []
    for length in lengths:
        for pp in pp_sizes:
            # (chunked pipelining, chunks sized by cost); PP=1 has no pipeline to fill.
            sizings = {"both": [True, False], "fixed": [False], "by-cost": [True]}
            modes = [(True, dynamic) for dynamic in sizings[args.chunk_sizes]]
            if pp > 1 and not args.no_compare:
                modes.append((False, False))
            for pipelining, dynamic in modes:
                results.append(run(args, pp, length, pipelining, dynamic))
                r = results[-1]
                print(
                    f"PP={pp} {length} tokens pipelining={pipelining} dynamic={dynamic}: "
                    f"TTFT {r['ttft_s']:.2f} s",
                    flush=True,
                )
    print(
        f"\n=== one long prompt, chunks of {args.max_num_batched_tokens} tokens a round, one "
        f"thread per stage, {args.decodes} requests decoding meanwhile, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f} ==="
    )
    rows = []
    for r in results:
        base = min(
            b["ttft_s"] for b in results if b["pp"] == 1 and b["prompt_len"] == r["prompt_len"]
        ) if 1 in pp_sizes else None  # fmt: skip
        ratio = f"{r['ttft_s'] / base:.2f}" if base else "-"
        efficiency = f"{base / (r['pp'] * r['ttft_s']):.0%}" if base else "-"
        rate = r["decode_tok_per_s"]
        rows.append(
            [
                r["prompt_len"],
                r["pp"],
                "-" if r["pp"] == 1 else "on" if r["pipelining"] else "off (one at a time)",
                "by cost" if r["dynamic_chunks"] else "fixed",
                f"{r['ttft_s']:.2f}",
                ratio,
                efficiency,
                "-" if rate is None else f"{rate:.1f}",
            ]
        )
    print_table(
        [
            "tokens",
            "PP",
            "chunked pipelining",
            "chunk sizes",
            "TTFT s",
            "vs PP=1",
            "scaling efficiency",
            "decode tok/s meanwhile",
        ],
        rows,
    )
    write_json(args.output_json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
