"""How far bf16 (the fast CPU path) drifts from HF transformers, greedy decoding.

    python -m benchmarks.bf16_accuracy [--max-tokens 32] [--smollm2-only]

For the tiny random models of the test suite and the bundled SmolLM2, compares our engine in
bfloat16 against HF transformers in float32 (the oracle) and prints, per model: prompts whose
whole output matches, the mean fraction of tokens generated before the first divergence
(prefix agreement), and position-wise token agreement. Our fp32 run is shown as the control.
Then SmolLM2 in bf16 against HF's own bf16, through both linear paths: oneDNN prepacked
weights (where this CPU allows it) and plain matmuls (VLLM_CPU_PACKED_LINEAR=0, the path of a
CPU without AVX-512); each row names the path that ran.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict[str, float]:
    exact = prefix = same = total = 0
    for a, b in zip(ours, ref):
        exact += a == b
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix += n / max(len(b), 1)
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
    return {"exact": exact / len(ref), "prefix": prefix / len(ref), "tokens": same / total}


def ours(model: str, prompts: list[str], dtype: str, max_tokens: int) -> list[list[int]]:
    return ours_with_path(model, prompts, dtype, max_tokens)[0]


def ours_with_path(
    model: str, prompts: list[str], dtype: str, max_tokens: int
) -> tuple[list[list[int]], str]:
    """Our greedy ids, and the linear-layer path the engine used."""
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_space=0.5, swap_space=0.1)
    try:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
        )
        path = llm.llm_engine.executor.worker.model_runner.model.linear_path
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--smollm2-only", action="store_true", help="skip the tiny random models")
    args = parser.parse_args()
    from benchmarks.common import load_prompts
    from tests.utils import tiny_models

    rows: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        kinds = {} if args.smollm2_only else tiny_models.model_dirs(tmp)
        for kind, path in kinds.items():
            ref = tiny_models.hf_greedy(path, tiny_models.PROMPTS, args.max_tokens)
            rows.append(
                (
                    kind,
                    agreement(ours(path, tiny_models.PROMPTS, "bfloat16", args.max_tokens), ref),
                    agreement(ours(path, tiny_models.PROMPTS, "float32", args.max_tokens), ref),
                )
            )
    prompts = load_prompts()[:16]
    ref = tiny_models.hf_smollm2_greedy(prompts, args.max_tokens)
    rows.append(
        (
            "smollm2",
            agreement(ours("smollm2", prompts, "bfloat16", args.max_tokens), ref),
            agreement(ours("smollm2", prompts, "float32", args.max_tokens), ref),
        )
    )
    import torch

    ref_bf16 = tiny_models.hf_smollm2_greedy(prompts, args.max_tokens, torch.bfloat16)
    path_rows = []
    for packed in ("1", "0"):
        os.environ["VLLM_CPU_PACKED_LINEAR"] = packed
        ids, path = ours_with_path("smollm2", prompts, "bfloat16", args.max_tokens)
        path_rows.append((path, agreement(ids, ref_bf16), agreement(ids, ref)))
    os.environ.pop("VLLM_CPU_PACKED_LINEAR")
    print(f"\nsmollm2 bf16 against HF bf16 and HF fp32 ({args.max_tokens} new tokens):")
    print("| linear path | vs HF bf16 exact | tokens | vs HF fp32 exact | tokens |")
    print("|---|---|---|---|---|")
    for path, vs_bf16, vs_fp32 in path_rows:
        print(
            f"| {path} | {vs_bf16['exact']:.0%} | {vs_bf16['tokens']:.0%} | "
            f"{vs_fp32['exact']:.0%} | {vs_fp32['tokens']:.0%} |"
        )
    print(f"\nGreedy agreement with HF fp32 ({args.max_tokens} new tokens):")
    print("| model | bf16 exact | bf16 prefix | bf16 tokens | fp32 exact | fp32 tokens |")
    print("|---|---|---|---|---|---|")
    for kind, bf16, fp32 in rows:
        print(
            f"| {kind} | {bf16['exact']:.0%} | {bf16['prefix']:.0%} | {bf16['tokens']:.0%} | "
            f"{fp32['exact']:.0%} | {fp32['tokens']:.0%} |"
        )


if __name__ == "__main__":
    main()
