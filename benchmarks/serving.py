"""Online serving benchmark (the shape of vLLM's benchmark_serving.py).

Sends `--num-prompts` streamed completions to a running OpenAI-compatible server with Poisson
arrivals at each `--request-rate` (requests/s; `inf` sends them all at once) and reports
request throughput, output tok/s, and TTFT / TPOT mean, median and p99.

    # against a server you started:
    python -m benchmarks.serving --base-url http://127.0.0.1:8000 --request-rate 1,4,inf
    # or let the script start (and stop) one, here with two pipeline stages:
    python -m benchmarks.serving --launch --model smollm2 --server-args "-pp 2" \
        --request-rate 1,4,inf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

WORDS = (
    "the of and to in is was for on are with as by at from that this have be it an or which "
    "pipeline parallel model cache token stage layer batch request server engine memory time "
    "river mountain city music history science garden window market story ocean light"
).split()


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    itl: list[float] = field(default_factory=list)


def make_prompts(n: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
        for _ in range(n)
    ]


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, output_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = (await resp.aread()).decode()[:200]
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except Exception as exc:  # recorded, the run goes on
        result.error = repr(exc)
    return result


async def run_rate(
    base_url: str, model: str, prompts: list[str], output_len: int, rate: float, seed: int
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, output_len)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, rate)


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = np.array([r.ttft for r in ok]) * 1000 if ok else np.zeros(1)
    tpot = (
        np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
        * 1000
        if ok
        else np.zeros(1)
    )
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "request_rate": rate,
        "completed": len(ok),
        "failed": len(errors),
        "first_error": errors[0] if errors else "",
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "mean_ttft_ms": float(np.mean(ttft)),
        "median_ttft_ms": float(np.median(ttft)),
        "p99_ttft_ms": float(np.percentile(ttft, 99)),
        "mean_tpot_ms": float(np.mean(tpot)) if len(tpot) else 0.0,
        "median_tpot_ms": float(np.median(tpot)) if len(tpot) else 0.0,
        "p99_tpot_ms": float(np.percentile(tpot, 99)) if len(tpot) else 0.0,
    }


def print_result(r: dict[str, Any]) -> None:
    rows = [
        ("Successful requests:", r["completed"]),
        ("Failed requests:", r["failed"]),
        ("Benchmark duration (s):", f"{r['duration']:.2f}"),
        ("Total input tokens:", r["total_input_tokens"]),
        ("Total generated tokens:", r["total_output_tokens"]),
        ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{r['total_token_throughput']:.2f}"),
    ]
    print("{s:{c}^50}".format(s=f" Serving Benchmark Result (rate {r['request_rate']}) ", c="="))
    for name, value in rows:
        print(f"{name:<40}{value:<10}")
    print("{s:{c}^50}".format(s="Time to First Token", c="-"))
    for kind in ("mean", "median", "p99"):
        print(f"{kind.capitalize() + ' TTFT (ms):':<40}{r[kind + '_ttft_ms']:<10.2f}")
    print("{s:{c}^50}".format(s="Time per Output Token (excl. 1st token)", c="-"))
    for kind in ("mean", "median", "p99"):
        print(f"{kind.capitalize() + ' TPOT (ms):':<40}{r[kind + '_tpot_ms']:<10.2f}")
    if r["first_error"]:
        print("first error:", r["first_error"])
    print("=" * 50, flush=True)


def launch_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    from vllm.distributed.net_utils import get_open_port

    port = get_open_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
        "--host", "127.0.0.1", "--port", str(port), "--disable-log-requests",
        "--uvicorn-log-level", "warning", *shlex.split(args.server_args),
    ]  # fmt: skip
    print("launching:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.launch_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError("the server did not become healthy in time")


def offline_reference(args: argparse.Namespace, prompts: list[str]) -> float:
    """Output tok/s of LLM.generate on the same prompts and settings, in a fresh process
    after the server has stopped: what the engine does without HTTP, at the same load."""
    code = (
        "import json, shlex, sys, time\n"
        "from vllm import LLM, SamplingParams\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.entrypoints.openai.api_server import make_arg_parser\n"
        "a = json.loads(sys.argv[1])\n"
        "ns = make_arg_parser().parse_args(['--model', a['model'], *shlex.split(a['extra'])])\n"
        "ea = EngineArgs.from_cli_args(ns)\n"
        "import dataclasses\n"
        "llm = LLM(**{k: v for k, v in dataclasses.asdict(ea).items()})\n"
        "p = SamplingParams(temperature=0, max_tokens=a['out'], ignore_eos=True)\n"
        "llm.generate(a['prompts'][:4], SamplingParams(max_tokens=8), use_tqdm=False)\n"
        "t = time.perf_counter()\n"
        "outs = llm.generate(a['prompts'], p, use_tqdm=False)\n"
        "dt = time.perf_counter() - t\n"
        "print('RESULT', sum(len(o.outputs[0].token_ids) for o in outs) / dt)\n"
    )
    payload = json.dumps(
        {"model": args.model, "extra": args.server_args, "out": args.output_len, "prompts": prompts}
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    out = subprocess.run(
        [sys.executable, "-c", code, payload], env=env, capture_output=True, text=True
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT"):
            return float(line.split()[1])
    raise RuntimeError(f"offline reference failed: {out.stderr[-2000:]}")


def served_model(base_url: str) -> str:
    return httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default=None, help="A running server (default: --launch).")
    p.add_argument("--launch", action="store_true", help="Start a server for the run.")
    p.add_argument("--model", default="smollm2", help="Model for --launch.")
    p.add_argument("--server-args", default="", help="Extra server flags for --launch.")
    p.add_argument("--launch-timeout", type=float, default=600.0)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-words", type=int, default=16)
    p.add_argument("--max-words", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", default="1,4,inf", help="Comma list of req/s ('inf').")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="Requests sent before timing.")
    p.add_argument("--json", default=None, help="Write the results to this file.")
    p.add_argument(
        "--offline-reference",
        action="store_true",
        help="After the run, time LLM.generate on the same prompts (same flags) for comparison.",
    )
    args = p.parse_args(argv)
    proc = None
    base_url = args.base_url
    if base_url is None:
        proc, base_url = launch_server(args)
    try:
        model = served_model(base_url)
        prompts = make_prompts(args.num_prompts, args.min_words, args.max_words, args.seed)
        if args.warmup:
            asyncio.run(run_rate(base_url, model, prompts[: args.warmup], 8, float("inf"), 0))
        results = []
        for rate_text in args.request_rate.split(","):
            rate = float(rate_text)
            result = asyncio.run(
                run_rate(base_url, model, prompts, args.output_len, rate, args.seed)
            )
            print_result(result)
            results.append(result)
        print("| rate (req/s) | req/s | output tok/s | TTFT mean / median / p99 (ms) | "
              "TPOT mean / median / p99 (ms) |")  # fmt: skip
        print("|---|---|---|---|---|")
        for r in results:
            print(
                f"| {r['request_rate']} | {r['request_throughput']:.2f} | "
                f"{r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} / "
                f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                f"{r['mean_tpot_ms']:.1f} / {r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} |"
            )
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.offline_reference:
        offline = offline_reference(args, prompts)
        best = max(r["output_throughput"] for r in results)
        print(
            f"offline LLM.generate, same prompts and flags: {offline:.1f} output tok/s; "
            f"best served rate reached {best / offline:.2f}x of it"
        )
        for r in results:
            r["offline_output_throughput"] = offline
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
