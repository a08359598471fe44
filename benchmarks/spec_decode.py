"""Speculative decoding (prompt lookup): one user's decode rate with and without it, in one run.

    python -m benchmarks.spec_decode                       # SmolLM2 Q4_1, PP 1 and 2
    python -m benchmarks.spec_decode --pp-sizes 1 --batch 64 --dtype float32
    python -m benchmarks.spec_decode --quantization none --dtype float32 --draft-model smollm2

With `--draft-model`, the drafts come from that model (the showcase: the shipped Q4_1 GGUF
drafting for the same model in fp32) instead of prompt lookup.

For each pipeline size two engines are built, one with `speculative_config` (n-gram, k drafts)
and one without (same model and settings; one thread per stage), and each times the same
requests one at a time (batch 1, greedy, `--max-tokens` new tokens): copy-heavy prompts (text
to repeat, code to edit) and ordinary chat prompts. Reported per prompt kind: output tokens/s
without and with speculation, the speedup, the draft acceptance rate, and whether the token ids
are the same (they must be: greedy speculation is exact). With `--batch N`, N chat requests at
once are timed too (speculation must not cost more than a few percent there: it pauses itself
above `disable_by_batch_size`, and while acceptance is low).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import env_var, print_table, write_json

TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase spending on public transport by ten percent, "
    "to keep the library open on Sundays, and to repair the old bridge over the river before "
    "the winter. The chair thanked everyone for their patience and closed the meeting at six."
)
CODE = (
    "def total_price(items, tax_rate):\n"
    "    total = 0\n"
    "    for item in items:\n"
    "        total += item.price * item.quantity\n"
    "    total = total * (1 + tax_rate)\n"
    "    return round(total, 2)\n"
)
PROMPTS = {
    "copy: repeat text": [f"Repeat the following text exactly, word for word:\n\n{TEXT}"],
    "copy: edit code": [
        "Rename the function total_price to compute_total and the variable total to amount "
        f"in this code. Output the whole code.\n\n{CODE}"
    ],
    "chat": [
        "Write a short poem about the sea.",
        "What are three good habits for learning a new language?",
    ],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="Model (default: bundled SmolLM2).")
    p.add_argument("--dtype", default="auto", help="As the engine flag.")
    p.add_argument("--quantization", default=None, help="As the engine flag (default: auto).")
    p.add_argument("--pp-sizes", default="1,2", help="Pipeline sizes, comma-separated.")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens.")
    p.add_argument("--draft-model", default=None, help="Draft model (default: prompt lookup).")
    p.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max.")
    p.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min.")
    p.add_argument("--max-tokens", type=int, default=128, help="New tokens per request.")
    p.add_argument("--batch", type=int, default=0, help="Also time N chat requests at once.")
    p.add_argument("--backend", default="mp", help="Backend for PP > 1 (mp, ray).")
    p.add_argument("--output-json", default=None, help="Write every figure to this file.")
    return p.parse_args(argv)


def _engine(args: argparse.Namespace, pp: int, spec: bool) -> Any:
    from vllm import LLM

    config = None
    if spec and args.draft_model:
        config = {"model": args.draft_model, "num_speculative_tokens": args.k}
    elif spec:
        config = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min,
        }
    with env_var("VLLM_CPU_THREADS_PER_STAGE", "1"):
        return LLM(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            pipeline_parallel_size=pp,
            distributed_executor_backend=args.backend if pp > 1 else None,
            speculative_config=config,
            max_num_seqs=max(64, args.batch),
        )


def _chat_ids(llm: Any, text: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _time(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, list[list[int]]]:
    """Seconds and token ids of `prompts` run together."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def measure(args: argparse.Namespace, pp: int, spec: bool) -> dict[str, Any]:
    """Per prompt kind: seconds, tokens and token ids one request at a time; the batch run."""
    from vllm import SamplingParams

    llm = _engine(args, pp, spec)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    result: dict[str, Any] = {"kinds": {}}
    try:
        _time(llm, [_chat_ids(llm, "Hello!")], SamplingParams(max_tokens=8))  # warm up
        planner = llm.llm_engine.scheduler.draft_planner
        for kind, texts in PROMPTS.items():
            before = None if planner is None else (planner.totals.num_draft_tokens,
                                                   planner.totals.num_accepted_tokens)  # fmt: skip
            seconds, tokens, ids = 0.0, 0, []
            for text in texts:
                took, out = _time(llm, [_chat_ids(llm, text)], greedy)
                seconds += took
                tokens += len(out[0])
                ids.extend(out)
            entry = {"seconds": seconds, "tokens": tokens, "ids": ids}
            if planner is not None and before is not None:
                drafted = planner.totals.num_draft_tokens - before[0]
                accepted = planner.totals.num_accepted_tokens - before[1]
                entry["acceptance"] = accepted / drafted if drafted else 0.0
            result["kinds"][kind] = entry
        if args.batch:
            chat = [
                _chat_ids(llm, f"Tell me a fact about the number {i}.") for i in range(args.batch)
            ]
            seconds, ids = _time(llm, chat, greedy)
            result["batch"] = {"seconds": seconds, "tokens": sum(len(i) for i in ids), "ids": ids}
    finally:
        llm.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import os

    drafts = f"draft model {args.draft_model}" if args.draft_model else "prompt lookup"
    print(f"{os.cpu_count()} CPUs; one thread per stage; drafts: {drafts}, k={args.k}")
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    for pp in [int(x) for x in args.pp_sizes.split(",")]:
        base = measure(args, pp, spec=False)
        spec = measure(args, pp, spec=True)
        for kind in PROMPTS:
            b, s = base["kinds"][kind], spec["kinds"][kind]
            b_rate, s_rate = b["tokens"] / b["seconds"], s["tokens"] / s["seconds"]
            same = b["ids"] == s["ids"]
            accepted = f"{100 * s.get('acceptance', 0.0):.0f}%"
            rows.append([pp, kind, f"{b_rate:.1f}", f"{s_rate:.1f}", f"{s_rate / b_rate:.2f}x",
                         accepted, "yes" if same else "NO"])  # fmt: skip
            results.append({"pp": pp, "kind": kind, "tok_s": b_rate, "spec_tok_s": s_rate,
                            "acceptance": s.get("acceptance"), "same_tokens": same})  # fmt: skip
        if args.batch:
            b, s = base["batch"], spec["batch"]
            b_rate, s_rate = b["tokens"] / b["seconds"], s["tokens"] / s["seconds"]
            same = b["ids"] == s["ids"]
            rows.append([pp, f"chat, batch {args.batch}", f"{b_rate:.1f}", f"{s_rate:.1f}",
                         f"{s_rate / b_rate:.2f}x", "-", "yes" if same else "NO"])  # fmt: skip
            results.append({"pp": pp, "kind": f"batch {args.batch}", "tok_s": b_rate,
                            "spec_tok_s": s_rate, "same_tokens": same})  # fmt: skip
    print_table(
        ["PP", "prompts", "tok/s", "tok/s speculative", "speedup", "accepted", "same tokens"],
        rows,
    )
    write_json(args.output_json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
