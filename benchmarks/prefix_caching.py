"""Automatic prefix caching: many requests sharing a long system prompt, with and without
`enable_prefix_caching`, measured in the same run.

    python -m benchmarks.prefix_caching                      # 128 requests, 500-token prefix
    python -m benchmarks.prefix_caching --num-requests 32    # quicker

Every request is the same ~500-token system prompt followed by a short question (from
benchmarks/prompts.txt), greedy, `--output-len` new tokens. Both engines (caching off, then on)
run the identical workload in this process after a warm-up request that shares nothing with it;
printed: time to first token (mean / median / p90 over requests, from arrival), total time,
prefill tokens actually computed, and the prefix cache hit rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks.common import load_prompts, print_table, write_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="Model (default: bundled SmolLM2).")
    p.add_argument("--num-requests", type=int, default=128, help="Requests per run.")
    p.add_argument("--prefix-len", type=int, default=500, help="System prompt tokens.")
    p.add_argument("--output-len", type=int, default=16, help="New tokens per request.")
    p.add_argument("--block-size", type=int, default=16, help="KV block size.")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="Stages.")
    p.add_argument("--enable-chunked-prefill", action="store_true", help="Both runs chunked.")
    p.add_argument("--kv-cache-space", type=float, default=1.0, help="KV GiB per stage (CPU).")
    p.add_argument("--output-json", default=None, help="Write every figure to this file.")
    return p.parse_args(argv)


def build_requests(tokenizer: Any, args: argparse.Namespace) -> list[list[int]]:
    """The shared system prompt (cut to exactly --prefix-len tokens) + one question each."""
    prompts = load_prompts()
    text = " ".join(prompts)
    system = tokenizer.encode("You are a helpful assistant. Context: " + text)[: args.prefix_len]
    questions = [p for p in prompts if len(tokenizer.encode(p)) <= 40]
    requests = []
    for i in range(args.num_requests):
        question = f"\nQuestion {i}: " + questions[i % len(questions)]
        requests.append(system + tokenizer.encode(question, add_special_tokens=False))
    return requests


def run(args: argparse.Namespace, caching: bool, requests: list[list[int]] | None) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        enable_prefix_caching=caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        pipeline_parallel_size=args.pipeline_parallel_size,
        block_size=args.block_size,
        kv_cache_space=args.kv_cache_space,
        max_model_len=2048,
    )
    try:
        if requests is None:
            requests = build_requests(llm.get_tokenizer(), args)
        # Warm-up: shares no block with the workload.
        llm.generate("Warm up the kernels.", SamplingParams(max_tokens=4), use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": r} for r in requests], params, use_tqdm=False)
        wall = time.perf_counter() - start
        stats = llm.llm_engine.scheduler.get_stats()
        bm = llm.llm_engine.scheduler.block_manager
        hit_tokens = bm.num_hit_blocks * args.block_size
    finally:
        llm.shutdown()
    ttfts = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs)
    prompt_tokens = sum(len(r) for r in requests)
    return {
        "caching": caching,
        "requests": requests,
        "wall_s": wall,
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "prompt_tokens": prompt_tokens,
        "computed_prompt_tokens": prompt_tokens - hit_tokens,
        "hit_rate": stats["gpu_prefix_cache_hit_rate"],
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    off = run(args, False, None)
    on = run(args, True, off["requests"])
    same = off["token_ids"] == on["token_ids"]
    print(
        f"\n=== prefix caching: {args.num_requests} requests, {args.prefix_len}-token shared "
        f"prefix, {args.output_len} new tokens, model {args.model}, PP="
        f"{args.pipeline_parallel_size}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} ==="
    )
    rows = []
    for r in (off, on):
        rows.append(
            [
                "on" if r["caching"] else "off",
                f"{r['ttft_mean_s']:.2f}",
                f"{r['ttft_median_s']:.2f}",
                f"{r['ttft_p90_s']:.2f}",
                f"{r['wall_s']:.2f}",
                f"{r['computed_prompt_tokens']}/{r['prompt_tokens']}",
                f"{r['hit_rate']:.3f}" if r["caching"] else "-",
            ]
        )
    print_table(
        ["caching", "TTFT mean s", "median s", "p90 s", "total s", "prefill computed", "hit rate"],
        rows,
    )
    print(
        f"with caching: TTFT mean {off['ttft_mean_s'] / on['ttft_mean_s']:.2f}x faster, total "
        f"{off['wall_s'] / on['wall_s']:.2f}x faster; greedy outputs identical: {same}"
    )
    for r in (off, on):
        del r["requests"], r["token_ids"]
    write_json(args.output_json, {"args": vars(args), "off": off, "on": on, "same": same})
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
