"""Multi-LoRA throughput: one batch mixing 4 adapters against the base model alone, same
workload, measured in one run (the cost of the grouped low-rank updates).

    python -m benchmarks.lora                        # 64 prompts x 64 tokens, SmolLM2
    python -m benchmarks.lora --num-prompts 16 --output-len 32 -pp 2

Adapters are written here in PEFT's layout (adapter_config.json + adapter_model.safetensors),
random rank-`--rank` updates of q/k/v/o/gate/up/down on every layer. Three configurations of
the same prompts (greedy, exactly --output-len tokens each, `ignore_eos`): an engine without
LoRA; the LoRA engine with every request on the base model; the LoRA engine with the requests
spread round-robin over the 4 adapters (`--max-loras 4`: all of them active in each step).
Both engines stay up and the configurations take turns, --repeats rounds after one untimed
round: other processes' load moves every run's time, and interleaving spreads its drift over
all three. The figures are the median of the rounds; "vs LoRA off" is the median of each
round's ratio to the LoRA-off run of the same round. The CPU columns count this process's CPU
seconds (PP=1 only: the stages of PP>1 are other processes): on a machine others load, wall
time mostly measures their load, CPU time the work done, cleanly with one thread per stage
(`VLLM_CPU_THREADS_PER_STAGE=1`; with more, threads waiting at a barrier count as busy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from benchmarks.common import (
    load_prompts,
    print_table,
    resolve,
    take_prompts,
    write_json,
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="A LLaMA-style model (default: SmolLM2).")
    p.add_argument("--num-prompts", type=int, default=64, help="Requests per run.")
    p.add_argument("--output-len", type=int, default=64, help="New tokens per request.")
    p.add_argument("--rank", type=int, default=8, help="Rank of the adapters.")
    p.add_argument("--repeats", type=int, default=3, help="Timed rounds (median kept; default 3).")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="Stages.")
    p.add_argument("--kv-cache-space", type=float, default=1.0, help="KV GiB per stage (CPU).")
    p.add_argument("--output-json", default=None, help="Write every figure to this file.")
    return p.parse_args(argv)


def write_adapter(config: Any, path: str, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter of `config` (a LLaMA-style HF config) in `path`."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = (config.num_key_value_heads or config.num_attention_heads) * head_dim
    q = config.num_attention_heads * head_dim
    shapes = {  # module -> (in, out)
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = 0.05 * torch.randn(rank, fan_in, generator=gen)
            tensors[f"{name}.lora_B.weight"] = 0.05 * torch.randn(fan_out, rank, generator=gen)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
    }  # fmt: skip
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f)
    return path


def engine(args: argparse.Namespace, lora: bool) -> Any:
    """The LLM of one configuration: without LoRA, or with 4 slots of --rank."""
    from vllm import LLM

    lora_args: dict[str, Any] = {}
    if lora:
        lora_args = dict(enable_lora=True, max_loras=4, max_lora_rank=max(8, args.rank))
    return LLM(
        model=args.model,
        pipeline_parallel_size=args.pipeline_parallel_size,
        kv_cache_space=args.kv_cache_space,
        **lora_args,
    )


def timed(llm: Any, prompts: list[str], params: Any, per_request: list[Any] | None) -> dict:
    """One generate call: wall and CPU seconds (this process) and generated tokens."""
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, lora_request=per_request, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "generated_tokens": generated,
        "tok_s": generated / wall,
        "cpu_tok_s": generated / cpu,
    }


def main(argv: list[str] | None = None) -> int:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    args = parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    prompts = take_prompts(load_prompts(), args.num_prompts)
    hf_config = resolve(args.model).hf_config
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    names = ["lora off", "lora on, base model", "lora on, 4 adapters mixed"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as root:
        loras = [
            LoRARequest(f"bench{i}", i + 1, write_adapter(hf_config, f"{root}/a{i}", args.rank, i))
            for i in range(4)
        ]
        mixed = [loras[i % len(loras)] for i in range(len(prompts))]
        plain, with_lora = engine(args, lora=False), engine(args, lora=True)
        try:
            for lora in loras:
                with_lora.llm_engine.add_lora(lora)  # loaded before the clock starts
            configs = {
                "lora off": (plain, None),
                "lora on, base model": (with_lora, None),
                "lora on, 4 adapters mixed": (with_lora, mixed),
            }
            # Round 0 untimed: oneDNN builds a kernel per new batch shape on first use, which
            # only the first engine of the process would otherwise pay.
            for round_ in range(args.repeats + 1):
                for name, (llm, per_request) in configs.items():
                    result = timed(llm, prompts, params, per_request)
                    if round_ > 0:
                        runs[name].append(result)
        finally:
            plain.shutdown()
            with_lora.shutdown()
    off = runs["lora off"]
    results = {}
    for name in names:
        rounds = runs[name]
        results[name] = {
            key: statistics.median(r[key] for r in rounds)
            for key in ("wall_s", "cpu_s", "tok_s", "cpu_tok_s")
        }
        results[name]["vs_lora_off"] = statistics.median(
            r["tok_s"] / o["tok_s"] for r, o in zip(rounds, off)
        )
        results[name]["cpu_vs_lora_off"] = statistics.median(
            r["cpu_tok_s"] / o["cpu_tok_s"] for r, o in zip(rounds, off)
        )
        results[name]["rounds"] = rounds
    print(
        f"\n=== LoRA: {args.num_prompts} prompts x {args.output_len} tokens, rank {args.rank}, "
        f"model {args.model}, PP={args.pipeline_parallel_size}, {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}, median of {args.repeats} interleaved rounds ==="
    )
    print_table(
        ["run", "total s", "tok/s", "vs LoRA off", "per round", "CPU s", "CPU tok/s", "vs off"],
        [
            [
                name,
                f"{r['wall_s']:.2f}",
                f"{r['tok_s']:.1f}",
                f"{r['vs_lora_off']:.2f}x",
                " ".join(f"{x['tok_s']:.0f}" for x in r["rounds"]),
                f"{r['cpu_s']:.2f}",
                f"{r['cpu_tok_s']:.1f}",
                f"{r['cpu_vs_lora_off']:.2f}x",
            ]
            for name, r in results.items()
        ],
    )
    write_json(args.output_json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
