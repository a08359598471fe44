"""Offline throughput, after vLLM's benchmarks/benchmark_throughput.py.

    python -m benchmarks.throughput --num-prompts 64 --output-len 128 -pp 2
    python -m benchmarks.throughput --num-prompts 16 --output-len 32 --compare-hf

All requests are submitted at once; every one generates exactly --output-len tokens
(`ignore_eos`). Sampling follows vLLM's script (temperature 1.0, top_p 1.0). Prompts: --dataset
(one per line), else exactly --input-len tokens each if given, else 8-200 words of real text.
The HF backend runs transformers' batched `generate` (left padding) with the same CPU thread
count as our engine used in total, so --compare-hf prints a like-for-like ratio.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from benchmarks.common import (
    load_prompts,
    load_tokenizer,
    resolve,
    synthetic_token_prompts,
    synthetic_word_prompts,
    take_prompts,
    write_json,
)

Prompt = str | list[int]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--backend",
        choices=["vllm", "hf"],
        default="vllm",
        help="vllm: this engine; hf: transformers' generate.",
    )
    p.add_argument(
        "--compare-hf",
        action="store_true",
        help="Run our engine, then HF in the same process; print the ratio.",
    )
    p.add_argument("--model", default="smollm2", help="Model (default: bundled SmolLM2).")
    p.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="Prompt length in tokens (default: 8-200 words of real text).",
    )
    p.add_argument("--output-len", type=int, default=128, help="New tokens per request.")
    p.add_argument("--num-prompts", type=int, default=64, help="Number of requests.")
    p.add_argument("--dataset", default=None, help="Prompts file, one prompt per line.")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="Model dtype (auto: the model's, fp32 if none).",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="Pipeline stages of our engine (1 thread each unless "
        "VLLM_CPU_THREADS_PER_STAGE is set).",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=256, help="Scheduler's max sequences per step."
    )
    p.add_argument("--kv-cache-space", type=float, default=4.0, help="KV GiB per stage (CPU).")
    p.add_argument(
        "--hf-max-batch-size",
        type=str,
        default="16",
        help="HF generate batch size; a comma list (e.g. 16,64,128) runs each and keeps HF's best.",
    )
    p.add_argument(
        "--hf-dtype",
        default=None,
        choices=["auto", "float32", "bfloat16"],
        help="HF's dtype (default: --dtype). E.g. ours in bf16 against HF fp32.",
    )
    p.add_argument(
        "--roofline",
        action="store_true",
        help="Also time the model's own GEMM shapes at the decode batch size and "
        "print the fraction of that matmul roofline our decode reached.",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of prompts and sampling.")
    p.add_argument("--output-json", default=None, help="Write the results to this file.")
    args = p.parse_args(argv)
    if args.compare_hf:
        args.backend = "vllm"
    return args


def make_prompts(args: argparse.Namespace) -> list[Prompt]:
    if args.dataset:
        return list(take_prompts(load_prompts(args.dataset), args.num_prompts, args.seed))
    if args.input_len:
        tokenizer = load_tokenizer(args.model)
        return list(synthetic_token_prompts(tokenizer, args.num_prompts, args.input_len, args.seed))
    return list(synthetic_word_prompts(args.num_prompts, seed=args.seed))


def report(
    name: str, num_requests: int, prompt_toks: int, out_toks: int, elapsed: float, threads: int
) -> dict[str, Any]:
    total = prompt_toks + out_toks
    # The first line is vLLM's format exactly, so tools that parse it keep working.
    print(f"=== backend: {name} ===")
    print(f"Throughput: {num_requests / elapsed:.2f} requests/s, {total / elapsed:.2f} tokens/s")
    print(
        f"Generated: {out_toks / elapsed:.2f} tokens/s "
        f"({out_toks} tokens in {elapsed:.2f} s, {threads} CPU threads)"
    )
    return {
        "backend": name,
        "elapsed_s": elapsed,
        "requests": num_requests,
        "prompt_tokens": prompt_toks,
        "output_tokens": out_toks,
        "requests_per_s": num_requests / elapsed,
        "tokens_per_s": total / elapsed,
        "generated_tokens_per_s": out_toks / elapsed,
        "threads": threads,
    }


def run_vllm(args: argparse.Namespace, prompts: list[Prompt]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        pipeline_parallel_size=args.pipeline_parallel_size,
        max_num_seqs=args.max_num_seqs,
        kv_cache_space=args.kv_cache_space,
    )
    try:
        threads = sum(info.threads for info in llm.llm_engine.get_stage_infos())
        params = SamplingParams(
            temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len
        )
        inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        llm.generate(inputs[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        model_config = llm.llm_engine.model_config
    finally:
        llm.shutdown()
    prompt_toks = sum(len(o.prompt_token_ids) for o in outputs)
    out_toks = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = report("vllm", len(prompts), prompt_toks, out_toks, elapsed, threads)
    if args.roofline:
        decode_s, decode_toks = decode_window(outputs)
        result.update(roofline(args, model_config, decode_toks, decode_s, threads))
    return result


def decode_window(outputs: list[Any]) -> tuple[float, int]:
    """(seconds, tokens) of the decode phase, from the requests' own timings (vLLM's
    RequestOutput.metrics): from the last first token to the last finish.

    Every token after a request's first comes out of a decode step. When all prompts are
    admitted at once (num_prompts <= max_num_seqs and the cache holds them), the scheduler
    prefills them all before any decode, so all those tokens fall inside this window."""
    first = max(o.metrics.first_token_time for o in outputs)
    last = max(o.metrics.finished_time for o in outputs)
    if min(o.metrics.finished_time for o in outputs) <= first:
        raise RuntimeError(
            "some requests finished before the last prefill: the decode "
            "window is not one batch (use --num-prompts <= --max-num-seqs)"
        )
    tokens = sum(len(c.token_ids) - 1 for o in outputs for c in o.outputs)
    return last - first, tokens


def roofline(
    args: argparse.Namespace, model_config: Any, decode_toks: int, decode_s: float, threads: int
) -> dict[str, Any]:
    """Decode GEMM FLOP/s reached vs the same GEMMs timed alone at the decode batch size."""
    import torch

    from benchmarks.roofline import model_gemm_roofline
    from vllm.model_executor.weight_utils import get_torch_dtype

    torch.set_num_threads(threads)
    rows = min(args.num_prompts, args.max_num_seqs)
    peak, flops_per_token = model_gemm_roofline(
        model_config, rows, get_torch_dtype(model_config.dtype)
    )
    achieved = decode_toks * flops_per_token / decode_s
    print(
        f"Roofline: model GEMMs at batch {rows}: {peak / 1e9:.1f} GFLOP/s; decode reached "
        f"{achieved / 1e9:.1f} GFLOP/s = {100 * achieved / peak:.0f}% of it "
        f"(decode {decode_s:.2f} s)"
    )
    return {
        "roofline_gflops": peak / 1e9,
        "decode_gflops": achieved / 1e9,
        "roofline_fraction": achieved / peak,
        "decode_s": decode_s,
    }


def default_threads() -> int:
    """What our engine would use at PP=1: the env override, else torch's default."""
    import torch

    return int(os.environ.get("VLLM_CPU_THREADS_PER_STAGE", "0")) or torch.get_num_threads()


def run_hf(args: argparse.Namespace, prompts: list[Prompt], threads: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm.model_executor.weight_utils import get_torch_dtype

    torch.set_num_threads(threads)
    config = resolve(args.model, args.hf_dtype or args.dtype)
    dtype = get_torch_dtype(config.dtype)
    if config.is_gguf:
        from vllm.transformers_utils.gguf_config import load_gguf_tokenizer

        directory, name = os.path.split(config.model)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
        tokenizer = load_gguf_tokenizer(config.model)
    else:
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    model.eval()
    tokenizer.padding_side = "left"
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    # Tokenised as our engine does it (tokenizer.encode), so prompt token counts agree.
    ids = [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]

    def generate(batch: list[list[int]], new_tokens: int) -> int:
        width = max(len(x) for x in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        out = model.generate(
            input_ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
        return (out.shape[1] - width) * len(batch)

    torch.manual_seed(args.seed)
    best: dict[str, Any] | None = None
    with torch.inference_mode():
        generate(ids[:1], 2)  # warm-up
        for batch_size in (int(b) for b in args.hf_max_batch_size.split(",")):
            start = time.perf_counter()
            out_toks = 0
            for i in range(0, len(ids), batch_size):
                out_toks += generate(ids[i : i + batch_size], args.output_len)
            elapsed = time.perf_counter() - start
            result = report(
                f"hf (batch {batch_size}, {config.dtype})",
                len(prompts),
                sum(len(x) for x in ids),
                out_toks,
                elapsed,
                threads,
            )
            result["batch_size"] = batch_size
            if best is None or result["generated_tokens_per_s"] > best["generated_tokens_per_s"]:
                best = result
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = make_prompts(args)
    results = []
    if args.backend == "vllm":
        results.append(run_vllm(args, prompts))
    if args.backend == "hf" or args.compare_hf:
        threads = results[0]["threads"] if results else default_threads()
        results.append(run_hf(args, prompts, threads))
    data: dict[str, Any] = {"args": vars(args), "results": results}
    if args.compare_hf:
        ratio = results[0]["generated_tokens_per_s"] / results[1]["generated_tokens_per_s"]
        print(
            f"Ratio ours/HF (generated tokens/s): {ratio:.2f}x "
            f"(ours: PP={args.pipeline_parallel_size}, dtype {args.dtype}; HF at its best "
            f"batch size {results[1]['batch_size']}; {results[0]['threads']} threads each)"
        )
        data["ratio_ours_over_hf"] = ratio
    write_json(args.output_json, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
