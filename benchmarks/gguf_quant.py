"""The bundled GGUF run as shipped (--quantization gguf) against dequantized fp32 and bf16.

    python -m benchmarks.gguf_quant [--threads 1] [--batches 1,4,16,128] [--decode-tokens 32]

In one run, on --threads cores (default 1; the engine's stage gets the same):
1. Memory bandwidth, STREAM-like: the best of several copies of a 256 MiB buffer (bytes read +
   bytes written per second), the physical limit of a decode step that reads every weight.
2. The block kernel alone at one token on each of SmolLM2's matmul shapes (weights streamed
   from memory: enough copies to overflow the last-level cache), as GB/s of weights read.
   Then the crossover of the quantized linear: the block kernel against dequantize + GEMM for
   gate/up (3072 x 576, Q4_1), down (576 x 1536, Q4_1) and the lm_head (49152 x 576, Q8_0)
   over token counts, and the same for the K-quants Q4_K / Q5_K / Q6_K on 3072 x 1536 (what
   `dense_min_tokens` in quantization/gguf.py is set from). Kernel
   timings are the calling thread's CPU time when --threads is 1 (robust to a shared
   machine), wall time otherwise.
3. Decode tokens/s at each batch size for Q4_1 as shipped (fp32 activations, then int8
   activations: VLLM_PP_GGUF_ACTIVATIONS=int8), fp32 and bf16
   (both dequantized at load, --quantization none): the time of prompts + D tokens minus that
   of the prompts + 1 token, over batch x (D - 1) tokens. With the bytes of weights a step
   reads (the stage's weights: the tied embedding is the lm_head, read whole every step) and
   the bandwidth limit they imply at batch 1; and the time of one token through the linear
   layers alone (the weight-reading part of a step, without the engine's per-step work), as
   the bandwidth it achieves.
4. Greedy agreement on 16 prompts x 32 tokens against HF transformers loading the same GGUF
   (dequantized to fp32), as benchmarks/bf16_accuracy.py does for bf16; at each first
   difference, HF's top-2 logit margin (a near tie, or a real disagreement).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from functools import partial
from typing import Any

from benchmarks.bf16_accuracy import agreement
from benchmarks.common import fmt_bytes, load_prompts, print_table

# (label, LLM keyword arguments, VLLM_PP_GGUF_ACTIVATIONS)
CONFIGS = [
    ("Q4_1 as shipped (fp32 act.)", {"quantization": "gguf", "dtype": "float32"}, "float"),
    ("Q4_1 as shipped (int8 act.)", {"quantization": "gguf", "dtype": "float32"}, "int8"),
    ("fp32 (dequantized)", {"quantization": "none", "dtype": "float32"}, "float"),
    ("bf16 (dequantized)", {"quantization": "none", "dtype": "bfloat16"}, "float"),
]


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by the best of `repeats` buffer copies."""
    import torch

    src = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}
_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# K-quants: bytes per 256-weight super-block, and where its fp16 d (and dmin) sit.
_K_BLOCK_BYTES = {12: 144, 13: 176, 14: 210}
_K_SCALE_AT = {12: 0, 13: 0, 14: 208}
# SmolLM2-135M's matmuls: (name, rows N, columns K, ggml type); q/k/v fused, gate/up fused.
SHAPES = [
    ("qkv", 960, 576, 3),
    ("o", 576, 576, 3),
    ("gate/up", 3072, 576, 3),
    ("down", 576, 1536, 3),
    ("lm_head", 49152, 576, 8),
]


def random_blocks(n: int, k: int, qtype: int) -> Any:
    """n x k random weights as GGUF blocks of `qtype` (finite fp16 scales), in the kernels'
    row layout."""
    import torch

    from vllm.model_executor.layers.quantization.gguf import repack_gguf_rows

    if qtype in _K_BLOCK_BYTES:  # random bytes, finite fp16 d (and dmin): valid super-blocks
        raw = torch.randint(0, 256, (n, k // 256, _K_BLOCK_BYTES[qtype]), dtype=torch.uint8)
        at, count = _K_SCALE_AT[qtype], 1 if qtype == 14 else 2
        halves = (torch.randn(n, k // 256, count).abs() * 0.002).half()
        raw[:, :, at : at + 2 * count] = halves.view(torch.uint8).view(n, k // 256, 2 * count)
        return raw.view(n, -1)

    size, scale_bytes = _BLOCK_BYTES[qtype], 4 if qtype == 3 else 2
    raw = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8)
    scales = (torch.randn(n, k // 32, scale_bytes // 2) * 0.02).half()
    raw[:, :, :scale_bytes] = scales.view(torch.uint8).view(n, k // 32, scale_bytes)
    return repack_gguf_rows(raw.view(n, -1), qtype)


def best_ms(fn: Any, clock: Any, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times) * 1e3


def kernel_bandwidth(clock: Any) -> list[list[Any]]:
    """Per SmolLM2 shape: us of the kernel at one token and GB/s of weights read, rotating
    over copies of the weight that together overflow the last-level cache."""
    import torch

    from vllm import _custom_ops as ops

    rows = []
    for name, n, k, qtype in SHAPES:
        nbytes = n * k // 32 * _BLOCK_BYTES[qtype]
        copies = max(2, (96 << 20) // nbytes)
        weights = [random_blocks(n, k, qtype) for _ in range(copies)]
        x = torch.randn(1, k)

        row = [f"{name} {n} x {k} {_TYPE_NAMES[qtype]}"]
        for kernel in (ops.gguf_linear, ops.gguf_linear_q8):

            def run(
                weights: list[Any] = weights, x: Any = x, qtype: int = qtype, fn: Any = kernel
            ) -> None:
                for w in weights:
                    fn(x, w, qtype)

            seconds = best_ms(run, clock, repeats=5) / 1e3 / copies
            row += [f"{seconds * 1e6:.1f}", f"{nbytes / seconds / 1e9:.1f}"]
        rows.append(row)
    return rows


def dequantize_and_gemm(x: Any, raw: Any, qtype: int) -> Any:
    """The many-token path: the weight dequantized to x's dtype, then the GEMM."""
    import torch.nn.functional as F

    from vllm import _custom_ops as ops

    return F.linear(x, ops.gguf_dequantize(raw, qtype, x.shape[1], x.dtype))


def crossover(clock: Any) -> list[list[Any]]:
    """Per shape and token count: ms of the block kernel and of dequantize + GEMM."""
    import torch

    from vllm import _custom_ops as ops

    cases = [
        ("gate/up", 3072, 576, 3, [1, 4, 16, 32, 48, 64]),
        ("down", 576, 1536, 3, [1, 4, 16, 32, 48, 64]),
        ("lm_head", 49152, 576, 8, [1, 64, 128, 256, 384]),
        *[("3072 x 1536", 3072, 1536, q, [1, 4, 16, 32, 48, 64]) for q in (12, 13, 14)],
    ]
    rows = []
    for name, n, k, qtype, tokens in cases:
        raw = random_blocks(n, k, qtype)
        for t in tokens:
            x = torch.randn(t, k)
            kernel = best_ms(partial(ops.gguf_linear, x, raw, qtype), clock)
            int8 = "-"
            if qtype in (2, 3, 8):
                int8 = f"{best_ms(partial(ops.gguf_linear_q8, x, raw, qtype), clock):.2f}"
            dense = best_ms(partial(dequantize_and_gemm, x, raw, qtype), clock)
            faster = "kernel" if kernel <= dense else "GEMM"
            rows.append(
                [f"{name} {_TYPE_NAMES[qtype]}", t, f"{kernel:.2f}", int8, f"{dense:.2f}", faster]
            )
    return rows


def linear_step_seconds(llm: Any, dtype: Any) -> float:
    """Best time of one token through every linear layer of the model (lm_head included):
    the weight-reading part of a batch-1 decode step, without the engine around it."""
    import torch

    from vllm.model_executor.layers.linear import ParallelLinearBase

    model = llm.llm_engine.executor.worker.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, ParallelLinearBase)]
    inputs = [torch.randn(1, m.in_features, dtype=dtype) for m in layers]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(5):
            start = time.perf_counter()
            for layer, x in zip(layers, inputs):
                layer._matmul(x, None)
            best = min(best, time.perf_counter() - start)
    return best


def make_llm(kwargs: dict[str, Any], activations: str, kv_cache_space: float) -> Any:
    """The bundled model with `kwargs`, its GGUF linears in `activations` arithmetic."""
    from vllm import LLM

    os.environ["VLLM_PP_GGUF_ACTIVATIONS"] = activations  # read when the weights load
    return LLM(
        "smollm2", kv_cache_space=kv_cache_space, swap_space=0.1, max_model_len=1024, **kwargs
    )


def decode_rates(
    kwargs: dict[str, Any], activations: str, batches: list[int], decode_tokens: int
) -> tuple[dict[int, float], dict[str, Any]]:
    """Decode tokens/s per batch size, and the stage's info (weights, linear path, and the
    time of one token through the linear layers alone)."""
    from vllm import SamplingParams

    llm = make_llm(kwargs, activations, 1.0)
    try:
        prompt = {"prompt_token_ids": list(range(1000, 1016))}  # 16 tokens

        def run(batch: int, tokens: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate([prompt] * batch, params, use_tqdm=False)
            return time.perf_counter() - start

        run(2, 4)  # warm-up
        rates = {}
        for batch in batches:
            prefill = min(run(batch, 1) for _ in range(2))
            full = run(batch, decode_tokens)
            rates[batch] = batch * (decode_tokens - 1) / max(full - prefill, 1e-9)
        info = dataclasses.asdict(llm.llm_engine.get_stage_infos()[0])
        import torch

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[kwargs["dtype"]]
        info["linear_step_s"] = linear_step_seconds(llm, dtype)
    finally:
        llm.shutdown()
    return rates, info


def greedy_agreement(max_tokens: int) -> list[list[Any]]:
    """Per config: agreement with HF fp32 on 16 prompts, and HF's margins where tokens differ."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.utils import tiny_models
    from vllm import SamplingParams
    from vllm.transformers_utils.gguf_config import load_gguf_tokenizer, resolve_model

    prompts = load_prompts()[:16]
    path = resolve_model("smollm2")
    directory, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = load_gguf_tokenizer(path)
    ref = tiny_models.hf_greedy_with(model, tokenizer, prompts, max_tokens)
    rows = []
    for label, kwargs, activations in CONFIGS:
        llm = make_llm(kwargs, activations, 0.5)
        try:
            outs = llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
            )
        finally:
            llm.shutdown()
        ours = [o.outputs[0].token_ids for o in outs]
        margins = []
        for prompt, a, b in zip(prompts, ours, ref):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if n is None:
                continue
            with torch.inference_mode():
                logits = model(torch.tensor([tokenizer.encode(prompt) + b[:n]])).logits[0, -1]
            top = torch.topk(logits.float(), 2).values
            margins.append(f"{float(top[0] - top[1]):.1e}")
        score = agreement(ours, ref)
        rows.append(
            [label, f"{score['exact']:.0%}", f"{score['tokens']:.0%}", ", ".join(margins) or "-"]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,4,16,128")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--accuracy-tokens", type=int, default=32)
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    os.environ["VLLM_CPU_THREADS_PER_STAGE"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    bandwidth = copy_bandwidth()
    print(
        f"\nMemory bandwidth (copy, read + write, {args.threads} thread(s)): "
        f"{bandwidth / 1e9:.1f} GB/s"
    )
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print("\nBlock kernel alone, one token, weights streamed from memory")
    print_table(["matmul", "fp32 act. us", "GB/s", "int8 act. us", "GB/s"], kernel_bandwidth(clock))
    print("\nQuantized linear: block kernel (fp32 / int8 act.) vs dequantize + GEMM (ms)")
    print_table(
        ["matmul", "tokens", "kernel", "int8 kernel", "dequant+GEMM", "faster (fp32 act.)"],
        crossover(clock),
    )

    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    all_rates = []
    for label, kwargs, activations in CONFIGS:
        rates, info = decode_rates(kwargs, activations, batches, args.decode_tokens)
        all_rates.append(rates)
        step_bytes = info["weight_bytes"]  # tied: the embedding is the lm_head, read each step
        limit = bandwidth / step_bytes
        linear_s = info["linear_step_s"]
        rows.append(
            [label, fmt_bytes(step_bytes), f"{limit:.1f}"]
            + [f"{rates[b]:.1f}" for b in batches]
            + [f"{rates[batches[0]] / limit:.0%}"]
            + [f"{linear_s * 1e3:.1f} ms = {step_bytes / linear_s / 1e9:.1f} GB/s"]
        )
        print(f"{label}: linear path {info.get('linear_path')}")
    fp32 = all_rates[[c[0] for c in CONFIGS].index("fp32 (dequantized)")]
    for row, rates in zip(rows, all_rates):
        row.append(" / ".join(f"{rates[b] / fp32[b]:.2f}" for b in batches))
    print(f"\nDecode tokens/s ({args.decode_tokens} tokens after a 16-token prompt)")
    print_table(
        ["weights", "bytes read / step", "bandwidth limit (tok/s, batch 1)"]
        + [f"batch {b}" for b in batches]
        + [f"batch {batches[0]} / limit", "1 token through the linears alone"]
        + ["/ fp32 (each batch)"],
        rows,
    )
    if not args.skip_accuracy:
        print(f"\nGreedy agreement with HF fp32 (16 prompts x {args.accuracy_tokens} tokens)")
        print_table(
            ["weights", "prompts exact", "tokens", "HF top-2 margin at each first difference"],
            greedy_agreement(args.accuracy_tokens),
        )
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
