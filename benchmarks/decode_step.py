"""Where one batch-1 decode step of the bundled GGUF goes (the quantized path, one thread).

    python -m benchmarks.decode_step [--repeats 3] [--profile] [--no-matmul] [--layer-op-ab]
                                     [--breakdown]

The step is timed as compare_llamacpp times it: per prompt (the first 4 of
benchmarks/prompts.txt), the process CPU time of prompt + 33 tokens minus that of prompt + 1
token, over 32 steps (CPU time: the machine is shared, waiting for a core is excluded). Printed
per repeat, then the best, with the greedy token ids (compare two trees: they must be equal).

--profile: instead, torch.profiler's top ops by self CPU time over the 4 x 33-token run, with
calls per step (record_shapes off: shapes are those of T = 1).
--no-matmul: the GGUF matmuls replaced by a copy of a zero [T, N] output (tokens become
meaningless): the step without them, i.e. attention, norms, RoPE, Python, engine, sampler,
and how much of it is the model's forward. The stub replaces the Python-side kernel, so it
also turns off the one-op layer (csrc/decode_layer.cpp calls the matmul kernel from C++).
--layer-op-ab: each repeat times the step with the one-op layer and then with the same kernels
called one by one from Python (llama_decode.USE_LAYER_OP), in the same process; prints the
medians, their ratio, and whether the greedy ids are equal.
--breakdown: where a step goes, with the matmuls in place: the thread CPU time per step of the
model's forward and within it the decoder layers (the one-op layers), the lm_head's logits,
the sampler, and what is left (the engine); then the matmuls alone, replayed on the model's own
blocks in the step's order (all 30 layers', so the weights stream from memory as in a step),
per shape with GB/s: the layers minus their matmuls is attention, norms, RoPE, KV write,
SwiGLU and the op's glue.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from benchmarks.common import load_prompts, load_tokenizer

NUM_PROMPTS = 4
# Bytes of a 32-weight block of Q4_0, Q4_1, Q8_0 (the types the bundled GGUF's layers use).
_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}
TOKENS = 33


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-matmul", action="store_true")
    parser.add_argument("--layer-op-ab", action="store_true")
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    os.environ["VLLM_CPU_THREADS_PER_STAGE"] = "1"
    import torch

    from vllm import LLM, SamplingParams
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import llama, llama_decode
    from vllm.transformers_utils.gguf_config import resolve_model

    torch.set_num_threads(1)
    model = resolve_model("smollm2")
    tokenizer = load_tokenizer(model)
    prompts = [tokenizer.encode(p) for p in load_prompts()[:NUM_PROMPTS]]
    if args.no_matmul:
        # Before the model loads: its layers pick (and keep) their kernel at load.
        zeros: dict[tuple[int, int], torch.Tensor] = {}

        def no_matmul(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
            shape = (x.shape[0], weight.shape[0])
            return zeros.setdefault(shape, torch.zeros(shape, dtype=x.dtype)).clone()

        ops.gguf_linear = no_matmul  # type: ignore[assignment]
        llama_decode.USE_LAYER_OP = False
    llm = LLM(model=model, dtype="float32", max_model_len=1024, kv_cache_space=0.5)
    full = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    steps = NUM_PROMPTS * (TOKENS - 1)

    def run(params: Any) -> tuple[float, list[list[int]]]:
        start = time.process_time()
        outs = [
            list(
                llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
                .outputs[0]
                .token_ids
            )
            for ids in prompts
        ]
        return time.process_time() - start, outs

    forward_s = [0.0]
    if args.no_matmul:
        forward = llama.LlamaForCausalLM.forward

        def timed_forward(self: Any, *a: Any, **k: Any) -> Any:
            start = time.thread_time()
            try:
                return forward(self, *a, **k)
            finally:
                forward_s[0] += time.thread_time() - start

        llama.LlamaForCausalLM.forward = timed_forward  # type: ignore[method-assign]

    run(full)  # warm-up
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(full)
        runs = NUM_PROMPTS * TOKENS
        print(f"torch.profiler, {NUM_PROMPTS} prompts x {TOKENS} tokens ({runs} steps)")
        print(f"{'op':55s} {'self CPU ms':>12s} {'calls/step':>11s}")
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        for event in events[:20]:
            calls = event.count / runs
            print(f"{event.key[:55]:55s} {event.self_cpu_time_total / 1e3:12.1f} {calls:11.1f}")
        return
    if args.layer_op_ab:
        layer_op_ab(run, full, first, steps, args.repeats)
        return
    if args.breakdown:
        breakdown(llm, run, full, first, steps, args.repeats)
        return
    best = float("inf")
    tokens: list[list[int]] = []
    for _ in range(args.repeats):
        forward_s[0] = 0.0
        one, _ = run(first)
        one_forward = forward_s[0]
        many, tokens = run(full)
        step_ms = (many - one) / steps * 1e3
        best = min(best, step_ms)
        line = f"decode step {step_ms:.2f} ms CPU ({1e3 / step_ms:.1f} tok/s)"
        if args.no_matmul:
            forward_ms = (forward_s[0] - 2 * one_forward) / steps * 1e3
            line += f", of which the model's forward {forward_ms:.2f} ms"
        print(line)
    print(f"best {best:.2f} ms ({1e3 / best:.1f} tok/s); load average {os.getloadavg()[0]:.1f}")
    if not args.no_matmul:
        print(f"tokens {tokens}")


def layer_op_ab(run: Any, full: Any, first: Any, steps: int, repeats: int) -> None:
    """Alternate the step with and without the one-op layer; medians and their ratio."""
    import statistics

    from vllm.model_executor.models import llama_decode

    times: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    for _ in range(repeats):
        for use_op in (True, False):
            llama_decode.USE_LAYER_OP = use_op
            one, _ = run(first)
            many, tokens[use_op] = run(full)
            times[use_op].append((many - one) / steps * 1e3)
    llama_decode.USE_LAYER_OP = True
    for use_op, label in ((True, "one op per layer"), (False, "kernel by kernel")):
        runs = ", ".join(f"{t:.2f}" for t in times[use_op])
        print(f"{label}: median {statistics.median(times[use_op]):.2f} ms ({runs})")
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    equal = tokens[True] == tokens[False]
    print(f"one op / kernel by kernel: {ratio:.3f}x; greedy ids equal: {equal}")
    print(f"load average {os.getloadavg()[0]:.1f}")


def _timed(owner: Any, name: str, totals: dict[str, float], key: str) -> None:
    """Wrap owner.name so its calls add their thread CPU time to totals[key]."""
    fn = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            totals[key] += time.thread_time() - start

    setattr(owner, name, wrapper)


def breakdown(llm: Any, run: Any, full: Any, first: Any, steps: int, repeats: int) -> None:
    """Per step (full run minus the 1-token run, over the steps): layers, logits, sampler,
    the rest; then the matmuls alone, replayed on the model's blocks."""
    import statistics

    import torch

    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.sampler import Sampler
    from vllm.model_executor.models import llama, llama_decode

    keys = ("forward", "layers", "logits", "sampler")
    totals = dict.fromkeys(keys, 0.0)
    run(full)  # binds the kernels and builds the plans before the layer ops are wrapped
    _timed(llama_decode, "_decode_layer", totals, "layers")
    _timed(llama.LlamaForCausalLM, "forward", totals, "forward")
    _timed(llama.LlamaForCausalLM, "compute_logits", totals, "logits")
    _timed(Sampler, "__call__", totals, "sampler")
    per_step: dict[str, list[float]] = {k: [] for k in ("step", *keys)}
    for _ in range(repeats):
        for k in keys:
            totals[k] = 0.0
        one, _ = run(first)
        at_one = dict(totals)
        many, _ = run(full)
        per_step["step"].append((many - one) / steps * 1e3)
        for k in keys:
            per_step[k].append((totals[k] - 2 * at_one[k]) / steps * 1e3)
    med = {k: statistics.median(v) for k, v in per_step.items()}
    rest = med["step"] - med["forward"] - med["logits"] - med["sampler"]

    # The matmuls alone on the model's own blocks, in the step's order.
    model = llm.llm_engine.executor.worker.model_runner.model
    plans = [layer.__dict__["_decode_plan"][1] for layer in model.model.layers]
    names = ("qkv", "o", "gate/up", "down")
    calls = []
    for plan in plans:
        blocks, qtypes, _ = plan.blocks
        for name, raw, qtype in zip(names, blocks, qtypes):
            k = raw.shape[1] // _BLOCK_BYTES[qtype] * 32
            calls.append((name, raw, qtype, torch.randn(1, k)))
    lm = model.lm_head.quant
    lm_raw, lm_qtype, _ = lm.decode_blocks()
    times = dict.fromkeys((*names, "lm_head"), float("inf"))
    for _ in range(5):
        spent = dict.fromkeys(times, 0.0)
        for name, raw, qtype, x in calls:
            start = time.thread_time()
            ops.gguf_linear(x, raw, qtype)
            spent[name] += time.thread_time() - start
        start = time.thread_time()
        ops.gguf_linear(torch.randn(1, lm.cols), lm_raw, lm_qtype)
        spent["lm_head"] += time.thread_time() - start
        times = {k: min(times[k], spent[k]) for k in times}
    nbytes = dict.fromkeys(times, 0)
    for name, raw, _, _ in calls:
        nbytes[name] += raw.numel()
    nbytes["lm_head"] = lm_raw.numel()
    layer_matmuls = sum(times[n] for n in names) * 1e3
    glue = med["forward"] - med["layers"]

    print(f"per step, medians of {repeats} runs (thread/process CPU ms):")
    print(f"  step {med['step']:.2f}")
    print(f"  model forward {med['forward']:.2f}")
    print(f"    outside the layer ops: embedding, plans, final norm {glue:.2f}")
    print(f"    decoder layers (one op each) {med['layers']:.2f}")
    print(f"      of which the matmuls (replayed alone) {layer_matmuls:.2f}")
    print(f"      the rest of the layers {med['layers'] - layer_matmuls:.2f}")
    print(f"  logits (lm_head) {med['logits']:.2f}")
    print(f"  sampler {med['sampler']:.2f}")
    print(f"  engine: scheduler, inputs, outputs, Python {rest:.2f}")
    print("matmuls alone, per step (all layers):")
    for name, seconds in times.items():
        print(f"  {name}: {seconds * 1e3:.3f} ms, {nbytes[name] / seconds / 1e9:.1f} GB/s")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
