"""Benchmark one engine: build an LLM, show its pipeline layout and a few completions, then time
`generate` at several batch sizes.

    python run.py --max_tokens 8 -bsl 1,2 --pipeline_parallel_size 2

Every request uses `ignore_eos=True`, so each one produces exactly `--max_tokens` tokens and the
figures of different runs are comparable. Flags keep the seed fork's spellings (`--max_tokens`,
`-bsl`); vLLM's hyphenated ones (`--max-tokens`, `-pp`) work too. CPU threads: each pipeline
stage uses 1 (PP>1) or all cores (PP=1) unless VLLM_CPU_THREADS_PER_STAGE is set.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import (
    fmt_bytes,
    print_stage_layout,
    print_table,
    stage_layout,
    stage_peak_memory,
    write_json,
)

# Timed prompts (cycled when a batch is larger): fixed so runs are comparable.
BENCH_PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works and why lookups are fast.",
    "List five fruits that are high in vitamin C.",
    "def quicksort(arr):",
]

# Shown as chat completions before timing: a quick look that the model says something sane.
DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain pipeline parallelism in one sentence.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help="HF model dir, .gguf file, or 'smollm2' (bundled, the default).",
    )
    parser.add_argument(
        "--max_tokens",
        "--max-tokens",
        dest="max_tokens",
        type=int,
        default=64,
        help="New tokens per request (ignore_eos: always exactly this many).",
    )
    parser.add_argument(
        "--pipeline_parallel_size",
        "--pipeline-parallel-size",
        "-pp",
        dest="pipeline_parallel_size",
        type=int,
        default=1,
        help="Pipeline stages; >1 runs one Ray worker per stage.",
    )
    parser.add_argument(
        "--tensor_parallel_size",
        "--tensor-parallel-size",
        "-tp",
        dest="tensor_parallel_size",
        type=int,
        default=1,
        help="Tensor parallel ranks per stage (heads, MLP and vocabulary "
        "split; world size = PP x TP).",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        "--distributed_executor_backend",
        dest="distributed_executor_backend",
        default=None,
        choices=["ray", "mp", "uni"],
        help="'ray' (default for world size > 1 when Ray is installed), 'mp' "
        "(local processes, no Ray) or 'uni'.",
    )
    parser.add_argument(
        "--gpu_memory_utilization",
        "--gpu-memory-utilization",
        dest="gpu_memory_utilization",
        type=float,
        default=0.9,
        help="Fraction of GPU memory for weights, activations and KV cache "
        "(CUDA only; the CPU uses --kv_cache_space).",
    )
    parser.add_argument(
        "-bsl",
        "--batch_sizes_list",
        "--batch-sizes-list",
        dest="batch_sizes_list",
        default="1,2,4,8",
        help="Comma-separated batch sizes to time, e.g. 1,2,4,8.",
    )
    parser.add_argument(
        "--pipeline",
        nargs="?",
        const=True,
        default=None,
        help="Accepted for compatibility with the seed fork and ignored: the "
        "engine always keeps pipeline_parallel_size batches in flight.",
    )
    parser.add_argument(
        "--kv_cache_space",
        "--kv-cache-space",
        dest="kv_cache_space",
        type=float,
        default=4.0,
        help="KV cache GiB per stage on CPU.",
    )
    parser.add_argument(
        "--max_model_len",
        "--max-model-len",
        dest="max_model_len",
        type=int,
        default=None,
        help="Context length (default: the model's); lower it to "
        "run with a small --kv_cache_space.",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="Weights/activations dtype (auto: the model's, fp32 if none).",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="Weight-only quantization: 'gguf' (the default for a .gguf model, so for the "
        "bundled one: its Q4_1 blocks are kept) or 'none' (dequantize at load to --dtype).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Engine random seed.")
    parser.add_argument(
        "--speculative-config",
        "--speculative_config",
        dest="speculative_config",
        default=None,
        help="Speculative decoding as JSON, as `vllm serve` takes it (e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\'); the timing table then '
        "shows the share of draft tokens accepted.",
    )
    parser.add_argument(
        "--output-json",
        "--output_json",
        dest="output_json",
        default=None,
        help="Write every figure (layout, completions, timings) to this file.",
    )
    args = parser.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes_list.split(",") if b.strip()]
    except ValueError:
        parser.error(
            f"--batch_sizes_list must be comma-separated integers, got {args.batch_sizes_list!r}"
        )
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error("--batch_sizes_list needs at least one batch size >= 1")
    if args.max_tokens < 1:
        parser.error("--max_tokens must be >= 1")
    return args


def show_completions(llm: Any, max_tokens: int) -> list[dict[str, Any]]:
    """Greedy chat replies to DEMO_QUESTIONS (plain prompts if the tokenizer has no template)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokenizer = llm.get_tokenizer()
    if getattr(tokenizer, "chat_template", None):
        convs = [[{"role": "user", "content": q}] for q in DEMO_QUESTIONS]
        outputs = llm.chat(convs, params, use_tqdm=False)
    else:
        outputs = llm.generate(DEMO_QUESTIONS, params, use_tqdm=False)
    shown = []
    print("\n=== Completions (greedy) ===")
    for question, out in zip(DEMO_QUESTIONS, outputs):
        text = out.outputs[0].text
        print(f"Q: {question}\nA: {text!r}")
        shown.append({"question": question, "text": text, "token_ids": out.outputs[0].token_ids})
    return shown


def time_batch(llm: Any, batch_size: int, max_tokens: int) -> dict[str, Any]:
    """One timed `generate` of `batch_size` prompts, `max_tokens` new tokens each."""
    from vllm import SamplingParams

    prompts = [BENCH_PROMPTS[i % len(BENCH_PROMPTS)] for i in range(batch_size)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    planner = llm.llm_engine.scheduler.draft_planner
    before = (0, 0) if planner is None else (
        planner.totals.num_draft_tokens, planner.totals.num_accepted_tokens
    )  # fmt: skip
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    latency = time.perf_counter() - start
    accepted = None
    if planner is not None:
        drafted = planner.totals.num_draft_tokens - before[0]
        accepted = (planner.totals.num_accepted_tokens - before[1]) / drafted if drafted else 0.0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "batch_size": batch_size,
        "latency_s": latency,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / latency,
        "total_tokens_per_s": (in_tokens + out_tokens) / latency,
        "peak_rss_bytes_per_stage": stage_peak_memory(llm),
        "draft_acceptance": accepted,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        pipeline_parallel_size=args.pipeline_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_space=args.kv_cache_space,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        quantization=args.quantization,
        seed=args.seed,
        speculative_config=args.speculative_config,
    )
    init_s = time.perf_counter() - start
    try:
        layout = stage_layout(llm)
        print(f"\n=== Engine (built in {init_s:.1f} s) ===")
        print_stage_layout(layout)
        completions = show_completions(llm, args.max_tokens)
        # Warm-up: first calls pay for allocator growth and lazy initialisation.
        time_batch(llm, 1, min(4, args.max_tokens))
        results = []
        for batch_size in args.batch_sizes:
            results.append(time_batch(llm, batch_size, args.max_tokens))
        print(
            f"\n=== Timing (max_tokens={args.max_tokens}, ignore_eos, greedy, "
            f"PP={args.pipeline_parallel_size}, TP={args.tensor_parallel_size}) ==="
        )
        rows = [
            [
                r["batch_size"],
                f"{r['latency_s']:.3f}",
                f"{r['output_tokens_per_s']:.2f}",
                f"{r['total_tokens_per_s']:.2f}",
                " / ".join(fmt_bytes(b) for b in r["peak_rss_bytes_per_stage"]),
                "off" if r["draft_acceptance"] is None else f"{100 * r['draft_acceptance']:.0f}%",
            ]
            for r in results
        ]
        headers = ["batch", "latency s", "output tok/s", "total tok/s", "peak RSS per rank"]
        print_table([*headers, "speculative: accepted"], rows)
        write_json(
            args.output_json,
            {
                "args": {k: v for k, v in vars(args).items() if k != "batch_sizes"},
                "init_seconds": init_s,
                "layout": layout,
                "completions": completions,
                "results": results,
            },
        )
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
