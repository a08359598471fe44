"""Offline batch inference with Ray Data: N engine instances, each with its own placement group.

vLLM's Ray Data pattern on this engine: the prompts are a Ray Dataset read from a file,
`map_batches` runs `vllm.batch.LLMPredictor` (one `LLM` per actor) on a fixed pool of
`--num-instances` actors, and each actor gets a placement group of PP x TP bundles
(`{"CPU": 1}` on CPU, `{"GPU": 1, "CPU": 1}` on GPU) that its engine's stages run in.

    python examples/ray_data_batch_inference.py --input benchmarks/prompts.txt --num-rows 64 \\
        --num-instances 2 --max-tokens 32 --temperature 0 --output /tmp/out.parquet --compare-llm
    python examples/ray_data_batch_inference.py -pp 2 --output /tmp/out.jsonl     # 1 x PP=2

Input: .txt (one prompt per line), .jsonl (`prompt` or `messages`, optional `sampling_params`,
other columns carried through) or .parquet. Output: a directory of Parquet or JSONL files with
the input columns plus prompt, generated_text, num_prompt_tokens, num_generated_tokens,
finish_reason and error ("" when the row succeeded). Ray Data prints its progress; at the end
this prints rows/s and generated tok/s, and with --compare-llm the same for one plain
`LLM.generate` over the same rows.
"""

from __future__ import annotations

import argparse
import os
import time

import ray

from vllm import LLM, SamplingParams
from vllm.batch import build_processor, read_dataset, read_outputs, write_dataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument(
        "--input",
        default=os.path.join(here, "..", "benchmarks", "prompts.txt"),
        help="prompts: .txt, .jsonl or .parquet (file or directory)",
    )
    p.add_argument(
        "--output",
        default="ray_data_output.parquet",
        help="output directory; .jsonl/.json suffix -> JSONL, else Parquet",
    )
    p.add_argument("--output-format", choices=["parquet", "jsonl"], default=None)
    p.add_argument("--model", default="smollm2", help="HF dir, .gguf, or smollm2")
    p.add_argument("--num-instances", type=int, default=1, help="engine replicas (actors)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="rows per map_batches call")
    p.add_argument("--num-rows", type=int, default=None, help="only the first N rows")
    p.add_argument(
        "--chat", action="store_true", help="apply the model's chat template to each prompt"
    )
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (per request)")
    p.add_argument("--kv-cache-space", type=float, default=1.0, help="KV GiB per stage (CPU)")
    p.add_argument("--swap-space", type=float, default=1.0, help="swap GiB per stage (CPU)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="logical CPUs of a new local Ray instance (default: enough for the "
        "instances' bundles plus one for Ray Data's read/write tasks)",
    )
    p.add_argument(
        "--compare-llm",
        action="store_true",
        help="then run one plain LLM.generate over the same rows and compare",
    )
    return p.parse_args()


def sampling(args: argparse.Namespace) -> dict:
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "kv_cache_space": args.kv_cache_space,
        "swap_space": args.swap_space,
        "max_num_seqs": args.max_num_seqs,
    }


def start_ray(args: argparse.Namespace) -> None:
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        ray.init(ignore_reinit_error=True)
        return
    world = args.pipeline_parallel_size * args.tensor_parallel_size
    need = args.num_instances * world + 1
    num_cpus = args.num_cpus or max(os.cpu_count() or 1, need)
    if num_cpus > (os.cpu_count() or 1):
        print(f"note: {num_cpus} logical CPUs on {os.cpu_count()} cores (oversubscribed)")
    # address="local": a new instance even if `ray start` left a cluster on this machine
    # (ray.init() would join that one, and refuse num_cpus).
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)


def report(name: str, rows: int, gen_tokens: int, seconds: float) -> None:
    print(
        f"{name}: {rows} rows, {gen_tokens} generated tokens in {seconds:.1f} s -> "
        f"{rows / seconds:.2f} rows/s, {gen_tokens / seconds:.1f} generated tok/s"
    )


def compare_llm(args: argparse.Namespace, prompts: list, df) -> None:
    """One plain LLM over the same rows (same engine settings, in this process / its own
    group), and whether greedy texts are identical."""
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        pipeline_parallel_size=args.pipeline_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        **engine_kwargs(args),
    )
    built = time.perf_counter()
    params = SamplingParams(**sampling(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    done = time.perf_counter()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    report("LLM.generate (engine start + generate)", len(outputs), tokens, done - start)
    report("LLM.generate (generate only)          ", len(outputs), tokens, done - built)
    llm.shutdown()
    if args.temperature == 0:
        ours = dict(
            zip(df["prompt"] if not args.chat else df["source_prompt"], df["generated_text"])
        )
        same = sum(ours.get(p) == o.outputs[0].text for p, o in zip(prompts, outputs))
        print(f"greedy texts identical to LLM.generate: {same}/{len(outputs)}")


def main() -> None:
    args = parse_args()
    run(args)


def run(args: argparse.Namespace) -> None:
    start_ray(args)
    ds = read_dataset(args.input)
    if args.num_rows:
        ds = ds.limit(args.num_rows)
    if args.chat:  # keep the raw text next to the templated prompt
        ds = ds.add_column("source_prompt", lambda batch: batch["prompt"])
    start = time.perf_counter()
    with build_processor(
        args.model,
        num_instances=args.num_instances,
        pipeline_parallel_size=args.pipeline_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        batch_size=args.batch_size,
        sampling_params=sampling(args),
        apply_chat_template=args.chat,
        engine_kwargs=engine_kwargs(args),
        device=args.device,
    ) as processor:
        fmt = write_dataset(processor(ds), args.output, args.output_format)
    seconds = time.perf_counter() - start
    df = read_outputs(args.output, fmt)
    print(f"Wrote {len(df)} rows to {args.output} ({fmt})")
    for row in df.head(3).itertuples():
        print(f"Prompt: {row.prompt!r}\nGenerated text: {row.generated_text!r}\n")
    failed = df[df["error"] != ""]
    if len(failed):
        print(f"{len(failed)} rows failed, first: {failed['error'].iloc[0]}")
    layout = (
        f"{args.num_instances} instance(s) x PP={args.pipeline_parallel_size} "
        f"x TP={args.tensor_parallel_size}"
    )
    report(
        f"Ray Data, {layout} (start to output written)",
        len(df),
        int(df["num_generated_tokens"].sum()),
        seconds,
    )
    if args.compare_llm:
        source = read_dataset(args.input)
        if args.num_rows:
            source = source.limit(args.num_rows)
        compare_llm(args, [r["prompt"] for r in source.take_all()], df)


if __name__ == "__main__":
    main()
