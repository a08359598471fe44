"""Speculative decoding (prompt lookup or a draft model): one user's decode rate with and
without it, in one run.

    python -m benchmarks.spec_decode                       # SmolLM2 Q4_1, PP 1 and 2
    python -m benchmarks.spec_decode --pp-sizes 1 --batch 64 --dtype float32
    python -m benchmarks.spec_decode --quantization none --dtype float32 --draft-model smollm2

With `--draft-model`, the drafts come from that model (the showcase: the shipped Q4_1 GGUF
drafting for the same model in fp32) instead of prompt lookup.

For each pipeline size two engines are built side by side, one with `speculative_config`
(n-gram or the draft model, k drafts) and one without (same model and settings; one thread
per stage), and the same requests are timed one at a time (batch 1, greedy, `--max-tokens`
new tokens), alternating between the engines `--repeats` times so both run under the same
load of a shared machine: copy-heavy prompts (text to repeat, code to edit) and ordinary chat
prompts. `--draft-placement` puts the draft model in the engine's process or a rank of its
own (VLLM_SPEC_DRAFT_PLACEMENT). Reported per prompt kind: output tokens/s
without and with speculation, the speedup, the draft acceptance rate, and whether the token ids
are the same (they must be: greedy speculation is exact). With `--batch N`, N chat requests at
once are timed too (speculation must not cost more than a few percent there: it pauses itself
above `disable_by_batch_size`, and while acceptance is low).
"""

from __future__ import annotations

import argparse
import os
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
    p.add_argument(
        "--draft-placement",
        default=None,
        choices=["driver", "rank"],
        help="Where the draft model runs (VLLM_SPEC_DRAFT_PLACEMENT; default: the engine's).",
    )
    p.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max.")
    p.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min.")
    p.add_argument("--max-tokens", type=int, default=128, help="New tokens per request.")
    p.add_argument("--repeats", type=int, default=2, help="Times each request runs on each engine.")
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
    placement = env_var("VLLM_SPEC_DRAFT_PLACEMENT", args.draft_placement)
    with env_var("VLLM_CPU_THREADS_PER_STAGE", "1"), placement:
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


def _acceptance(llm: Any) -> tuple[int, int]:
    planner = llm.llm_engine.scheduler.draft_planner
    return (0, 0) if planner is None else (planner.totals.num_draft_tokens,
                                           planner.totals.num_accepted_tokens)  # fmt: skip


def measure(args: argparse.Namespace, pp: int) -> dict[str, dict[str, Any]]:
    """Both engines (without and with speculation) built side by side; each request is timed
    on one, then on the other, `--repeats` times: the machine is shared, and alternating puts
    both under the same load. Per engine ("base", "spec"), per prompt kind: seconds, tokens,
    token ids (of the first repeat) and the acceptance; the batch run."""
    from vllm import SamplingParams

    engines = {"base": _engine(args, pp, spec=False)}
    result: dict[str, dict[str, Any]] = {"base": {"kinds": {}}, "spec": {"kinds": {}}}
    try:
        engines["spec"] = _engine(args, pp, spec=True)
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        for llm in engines.values():
            _time(llm, [_chat_ids(llm, "Hello!")], SamplingParams(max_tokens=8))  # warm up
        for kind, texts in PROMPTS.items():
            before = _acceptance(engines["spec"])
            entries = {name: {"seconds": 0.0, "tokens": 0, "ids": []} for name in engines}
            for repeat in range(args.repeats):
                for text in texts:
                    for name, llm in engines.items():
                        took, out = _time(llm, [_chat_ids(llm, text)], greedy)
                        entries[name]["seconds"] += took
                        entries[name]["tokens"] += len(out[0])
                        if repeat == 0:
                            entries[name]["ids"].extend(out)
            drafted, accepted = (a - b for a, b in zip(_acceptance(engines["spec"]), before))
            entries["spec"]["acceptance"] = accepted / drafted if drafted else 0.0
            for name, entry in entries.items():
                result[name]["kinds"][kind] = entry
        if args.batch:
            for name, llm in engines.items():
                chat = [
                    _chat_ids(llm, f"Tell me a fact about the number {i}.")
                    for i in range(args.batch)
                ]
                seconds, ids = _time(llm, chat, greedy)
                tokens = sum(len(i) for i in ids)
                result[name]["batch"] = {"seconds": seconds, "tokens": tokens, "ids": ids}
    finally:
        for llm in engines.values():
            llm.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    drafts = f"draft model {args.draft_model}" if args.draft_model else "prompt lookup"
    if args.draft_model:
        drafts += (
            f" ({args.draft_placement or os.environ.get('VLLM_SPEC_DRAFT_PLACEMENT') or 'driver'})"
        )
    print(f"{os.cpu_count()} CPUs; one thread per stage; drafts: {drafts}, k={args.k}")
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    for pp in [int(x) for x in args.pp_sizes.split(",")]:
        both = measure(args, pp)
        base, spec = both["base"], both["spec"]
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
    different = [f"PP {r['pp']} {r['kind']}" for r in results if not r["same_tokens"]]
    if different:
        # Greedy speculation is exact by construction: a difference is a bug, not noise.
        print(f"ERROR: speculation changed the greedy tokens of: {', '.join(different)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
