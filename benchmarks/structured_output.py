"""The per-step cost of structured outputs: decode tokens/s with and without a JSON schema on
the same workload (same prompts, batch and token count), plus the mask's own cost per row.

    python -m benchmarks.structured_output [--model smollm2] [--batch 8] [--max-tokens 64]
        [--rounds 3] [-pp 1]

The constrained run uses a schema whose output cannot end early (exactly 200 objects with
bounded fields, no whitespace), so both runs generate the same number of tokens (the
unconstrained run uses `ignore_eos` for the same reason). Each configuration is warmed up once
(which compiles the grammar), then the two alternate for `--rounds` rounds, so load from other
processes on a shared machine falls on both alike; the median run of each is reported, with the
ratio of the medians and the median of the per-round ratios. At PP=1 the engine runs in this
process, so its CPU time is reported too: tokens per CPU second are less sensitive to other
processes than wall time. The mask's own cost is
measured by replaying the constrained outputs' tokens through fresh matchers: the mean time to
fill one row's bitmask at each position, plus applying it to the logits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    # Exactly 200 items: the output cannot end before max_tokens, whatever the model prefers.
    "minItems": 200,
    "maxItems": 200,
}
PROMPT = "List the users of the system as JSON:"


class Run(NamedTuple):
    tokens: int
    seconds: float
    cpu_seconds: float
    outputs: list


def run(llm, params, batch: int) -> Run:
    """Tokens generated, wall and CPU seconds (this process) and outputs of one batch."""
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([f"{PROMPT} #{i}" for i in range(batch)], params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return Run(sum(len(o.outputs[0].token_ids) for o in outputs), elapsed, cpu, outputs)


def mask_cost(llm, outputs) -> float:
    """Mean seconds per sampled token to fill its row's bitmask and apply it, replaying the
    constrained outputs' tokens (the states the engine really met)."""
    import torch
    import xgrammar as xgr

    from vllm.structured_output.compiler import compile_cache_for
    from vllm.structured_output.params import StructuredOutputsParams, grammar_spec

    engine = llm.llm_engine
    cache = compile_cache_for(engine.model_config, engine.get_tokenizer())
    spec = grammar_spec(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    compiled = cache.compile(spec)
    vocab = engine.model_config.get_vocab_size()
    logits = torch.randn(1, vocab)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    elapsed, count = 0.0, 0
    for output in outputs:
        matcher = xgr.GrammarMatcher(compiled)
        for token in output.outputs[0].token_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=[0])
            elapsed += time.perf_counter() - start
            count += 1
            if not matcher.accept_token(token):
                break
    return elapsed / max(count, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(args.model, pipeline_parallel_size=args.pipeline_parallel_size)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
    configs = (("no schema", plain), ("json schema", constrained))
    for _, params in configs:
        run(llm, params, args.batch)  # warm-up (and the grammar's compile)
    runs: dict[str, list[Run]] = {name: [] for name, _ in configs}
    for _ in range(args.rounds):
        for name, params in configs:
            runs[name].append(run(llm, params, args.batch))
    print(f"model={args.model} batch={args.batch} max_tokens={args.max_tokens} "
          f"pp={args.pipeline_parallel_size} rounds={args.rounds}")  # fmt: skip
    median: dict[str, float] = {}
    for name, results in runs.items():
        rates = [r.tokens / r.seconds for r in results]
        median[name] = statistics.median(rates)
        line = (f"{name:12s} {results[0].tokens:6d} tokens/run: median {median[name]:7.1f} "
                f"tok/s (runs: {', '.join(f'{x:.1f}' for x in rates)})")  # fmt: skip
        if args.pipeline_parallel_size == 1:
            cpu = statistics.median(r.tokens / r.cpu_seconds for r in results)
            line += f"; {cpu:.1f} tok per CPU s"
        print(line)
    pairs = [
        (s.tokens / s.seconds) / (p.tokens / p.seconds)
        for p, s in zip(runs["no schema"], runs["json schema"])
    ]
    print(f"json schema / no schema: {median['json schema'] / median['no schema']:.3f} "
          f"(median of per-round ratios {statistics.median(pairs):.3f})")  # fmt: skip
    if args.pipeline_parallel_size == 1:
        cpu_ratio = statistics.median(
            (p.cpu_seconds / p.tokens) / (s.cpu_seconds / s.tokens)
            for p, s in zip(runs["no schema"], runs["json schema"])
        )
        print(f"json schema / no schema, per CPU second: {cpu_ratio:.3f}")
    mask = mask_cost(llm, runs["json schema"][-1].outputs)
    print(f"mask fill + apply: {mask * 1e6:.1f} us per row")
    llm.shutdown()


if __name__ == "__main__":
    main()
