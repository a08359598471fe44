"""Side by side with llama.cpp: the same GGUF file, the same prompts, the same core.

    python -m benchmarks.compare_llamacpp [--llamacpp-python PATH] [--model smollm2]
        [--cpu N] [--num-prompts 4] [--output-len 64] [--isas best,avx2] [--rounds 2]

llama.cpp is an optional peer in its own environment, never a dependency of this project:
`python -m benchmarks.llamacpp_install /work/peers/llamacpp` makes one (a venv with the
prebuilt `llama-cpp-py-sync` wheel), and --llamacpp-python (or $VLLM_PP_LLAMACPP_PYTHON) names
its interpreter. Without one the benchmark says so and exits 0.

In one run, both engines pinned to the same single core (--cpu; sched_setaffinity, inherited
by the peer's process) and one thread each:
- the prompts (the first --num-prompts lines of benchmarks/prompts.txt) tokenized once with the
  engine's tokenizer; both engines get the same token ids;
- llama.cpp (benchmarks/llamacpp_peer.py in the peer's interpreter): per prompt, --output-len
  greedy tokens, timing decode steps 2..N;
- our engine, `LLM(model=<gguf>)` (the quantized path, fp32 activations) with the C++ kernels
  at each ISA of --isas (`best` is this CPU's): per prompt, the time of prompt + N tokens minus
  that of prompt + 1 token, over N - 1 steps;
- batch-1 decode tokens/s of each, as wall time and as process CPU time (the machine is shared:
  CPU time excludes waiting for the core), the best of --rounds rounds (llama.cpp, then ours,
  each round), and the ratio ours / llama.cpp;
- greedy token agreement between the two (prompts exact, share of tokens equal), and at each
  first difference our top-2 logprob margin (a near tie, or a real disagreement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bf16_accuracy import agreement
from benchmarks.common import load_prompts, load_tokenizer, print_table

PEER_SCRIPT = Path(__file__).with_name("llamacpp_peer.py")
ENV_VAR = "VLLM_PP_LLAMACPP_PYTHON"


def peer_python(flag: str | None) -> str | None:
    """The peer's interpreter (flag, then $VLLM_PP_LLAMACPP_PYTHON) if it imports the bindings."""
    path = flag or os.environ.get(ENV_VAR)
    if not path:
        return None
    if not os.access(path, os.X_OK):
        raise ValueError(f"--llamacpp-python: {path!r} is not an executable interpreter")
    probe = subprocess.run(
        [path, "-c", "import llama_cpp_py_sync"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode != 0:
        raise ValueError(
            f"--llamacpp-python: {path} cannot import llama_cpp_py_sync "
            f"({probe.stderr.strip().splitlines()[-1:]}); make the peer with "
            "python -m benchmarks.llamacpp_install DIR"
        )
    return path


def run_llamacpp(
    python: str, model: str, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """llama.cpp's tokens and decode times (benchmarks/llamacpp_peer.py), one thread."""
    request = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "threads": 1}
    done = subprocess.run(
        [python, str(PEER_SCRIPT)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp peer failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def run_ours(
    llm: Any, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None
) -> dict[str, Any]:
    """Our tokens and decode times (prompt + N tokens minus prompt + 1, per prompt); with
    `logprobs`, also the top logprobs of every generated token (a run not timed for the
    table: computing them costs a log-softmax per step that llama.cpp's run does not do)."""
    from vllm import SamplingParams

    full = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    results = []
    for ids in prompts:
        prompt = {"prompt_token_ids": ids}
        clocks = []
        for params in (first, full):
            wall, cpu = time.perf_counter(), time.process_time()
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            clocks.append((time.perf_counter() - wall, time.process_time() - cpu))
        results.append(
            {
                "tokens": list(out.token_ids),
                "decode_wall_s": clocks[1][0] - clocks[0][0],
                "decode_cpu_s": clocks[1][1] - clocks[0][1],
                "logprobs": out.logprobs,
            }
        )
    return {"results": results}


def rate(run: dict[str, Any], key: str, max_tokens: int) -> float:
    """Decode tokens/s over all prompts: (N - 1) steps each over their summed seconds."""
    seconds = sum(r[key] for r in run["results"])
    return len(run["results"]) * (max_tokens - 1) / max(seconds, 1e-9)


def first_difference_margins(ours: dict[str, Any], peer: dict[str, Any]) -> list[str]:
    """Per differing prompt: position of the first difference, and our top-2 logprob margin
    there (logprobs differ by the logits' difference)."""
    notes = []
    for i, (a, b) in enumerate(zip(ours["results"], peer["results"])):
        n = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        if n is None:
            continue
        top = sorted((lp.logprob for lp in a["logprobs"][n].values()), reverse=True)
        margin = top[0] - top[1] if len(top) > 1 else float("nan")
        notes.append(f"prompt {i} at token {n}: margin {margin:.3g}")
    return notes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llamacpp-python", default=None, help=f"or ${ENV_VAR}")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--cpu", type=int, default=None, help="core for both (default: the last)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--isas", default="best", help="comma-separated: best, avx512, avx2, generic"
    )
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.output_len < 2:
        raise ValueError(f"--output-len must be at least 2, got {args.output_len}")
    python = peer_python(args.llamacpp_python)
    if python is None:
        print(
            f"llama.cpp is not installed: skipping. Make the peer with `python -m "
            f"benchmarks.llamacpp_install /work/peers/llamacpp`, then pass --llamacpp-python "
            f"/work/peers/llamacpp/bin/python (or set {ENV_VAR})."
        )
        return
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})  # inherited by the peer's process and our engine's threads
    os.environ["VLLM_CPU_THREADS_PER_STAGE"] = "1"

    import torch

    from vllm import LLM
    from vllm import _custom_ops as ops
    from vllm.transformers_utils.gguf_config import resolve_model

    torch.set_num_threads(1)
    model = resolve_model(args.model)
    tokenizer = load_tokenizer(model)
    prompts = [tokenizer.encode(p) for p in load_prompts()[: args.num_prompts]]
    isas = [ops.cpu_isa() if i == "best" else i for i in args.isas.split(",")]
    print(f"model {model}, core {cpu}, {len(prompts)} prompts x {args.output_len} tokens")
    print(f"load average before: {os.getloadavg()}")

    llm = LLM(model=model, dtype="float32", max_model_len=1024, kv_cache_space=0.5)
    peer_runs: list[dict[str, Any]] = []
    our_runs: dict[str, list[dict[str, Any]]] = {isa: [] for isa in isas}
    with_logprobs: dict[str, dict[str, Any]] = {}
    try:
        for _ in range(args.rounds):
            peer_runs.append(run_llamacpp(python, model, prompts, args.output_len))
            for isa in isas:
                ops.set_cpu_isa(isa)
                run_ours(llm, prompts[:1], 4)  # warm-up at this ISA
                our_runs[isa].append(run_ours(llm, prompts, args.output_len))
        for isa in isas:  # the tokens again, with the top-2 margins at any difference
            ops.set_cpu_isa(isa)
            with_logprobs[isa] = run_ours(llm, prompts, args.output_len, logprobs=2)
    finally:
        llm.shutdown()
    print(f"load average after: {os.getloadavg()}")
    info = peer_runs[0]
    print(
        f"llama.cpp: {info['package']} (commit {info['llama_cpp_commit']}), {info['system_info']}"
    )

    def best(runs: list[dict[str, Any]], key: str) -> float:
        return max(rate(r, key, args.output_len) for r in runs)

    peer_wall, peer_cpu = best(peer_runs, "decode_wall_s"), best(peer_runs, "decode_cpu_s")
    rows = [["llama.cpp", f"{peer_wall:.1f}", f"{peer_cpu:.1f}", "1.00", "1.00", "-", "-"]]
    peer_tokens = [r["tokens"] for r in peer_runs[0]["results"]]
    for isa in isas:
        wall, cpu_rate = best(our_runs[isa], "decode_wall_s"), best(our_runs[isa], "decode_cpu_s")
        ours_tokens = [r["tokens"] for r in with_logprobs[isa]["results"]]
        assert ours_tokens == [r["tokens"] for r in our_runs[isa][0]["results"]]
        agree = agreement(ours_tokens, peer_tokens)
        rows.append(
            [
                f"vllm-pp Q4_1 as shipped ({isa} kernels)",
                f"{wall:.1f}",
                f"{cpu_rate:.1f}",
                f"{wall / peer_wall:.2f}",
                f"{cpu_rate / peer_cpu:.2f}",
                f"{agree['exact']:.0%} of prompts, {agree['tokens']:.0%} of tokens",
                "; ".join(first_difference_margins(with_logprobs[isa], peer_runs[0])) or "-",
            ]
        )
    print(f"\nBatch-1 decode on core {cpu}, one thread (best of {args.rounds} rounds)")
    print_table(
        [
            "engine",
            "tok/s (wall)",
            "tok/s (CPU time)",
            "/ llama.cpp (wall)",
            "/ llama.cpp (CPU)",
            "greedy tokens equal to llama.cpp's",
            "first differences (our top-2 margin)",
        ],
        rows,
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
