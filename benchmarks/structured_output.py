"""The per-step cost of structured outputs: decode tokens/s with and without a JSON schema on
the same workload (same prompts, batch and token count), plus the mask's own cost per row.

    python -m benchmarks.structured_output [--model smollm2] [--batch 8] [--max-tokens 64] [-pp 1]

The constrained run uses a schema whose output cannot end early (exactly 200 objects with
bounded fields, no whitespace), so both runs generate the same number of tokens (the
unconstrained run uses `ignore_eos` for the same reason). Each configuration is run twice and the
second run is reported (the first warms up and compiles the grammar). The mask's own cost is
measured by replaying the constrained outputs' tokens through fresh matchers: the mean time to
fill one row's bitmask at each position, plus applying it to the logits.
"""

from __future__ import annotations

import argparse
import time

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


def run(llm, params, batch: int) -> tuple[int, float, list]:
    """(tokens generated, seconds, outputs) of one batch."""
    start = time.perf_counter()
    outputs = llm.generate([f"{PROMPT} #{i}" for i in range(batch)], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs), elapsed, outputs


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
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(args.model, pipeline_parallel_size=args.pipeline_parallel_size)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
    results = {}
    for name, params in (("no schema", plain), ("json schema", constrained)):
        run(llm, params, args.batch)
        results[name] = run(llm, params, args.batch)
    print(f"model={args.model} batch={args.batch} max_tokens={args.max_tokens} "
          f"pp={args.pipeline_parallel_size}")  # fmt: skip
    for name, (tokens, seconds, _) in results.items():
        print(f"{name:12s} {tokens:6d} tokens in {seconds:7.2f} s: {tokens / seconds:8.1f} tok/s")
    base = results["no schema"][0] / results["no schema"][1]
    with_schema = results["json schema"][0] / results["json schema"][1]
    print(f"json schema / no schema: {with_schema / base:.3f}")
    print(f"mask fill + apply: {mask_cost(llm, results['json schema'][2]) * 1e6:.1f} us per row")
    llm.shutdown()


if __name__ == "__main__":
    main()
