"""Where a served token's CPU goes: the HTTP/SSE thread (uvicorn, pydantic, JSON) against the
engine's step thread and the whole process, from per-thread CPU times (psutil). Unlike
throughput, this hardly depends on how loaded the machine is.

    python -m benchmarks.serving_cpu --model smollm2 [--num-prompts 48 --output-len 64]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import psutil
import uvicorn

from benchmarks import serving
from vllm import AsyncEngineArgs, AsyncLLMEngine
from vllm.distributed.net_utils import get_open_port
from vllm.entrypoints.openai.api_server import build_app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    engine = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(
            model=args.model,
            pipeline_parallel_size=args.pipeline_parallel_size,
            disable_log_requests=True,
            served_model_name="m",
        )
    )
    port = get_open_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    ids = {t.name: t.native_id for t in threading.enumerate()}
    proc = psutil.Process()

    def cpu() -> dict[int, float]:
        return {t.id: t.user_time + t.system_time for t in proc.threads()}

    prompts = serving.make_prompts(args.num_prompts, 16, 128, 0)
    asyncio.run(serving.run_rate(url, "m", prompts[:4], 8, float("inf"), 0))  # warm-up
    before = cpu()
    result = asyncio.run(serving.run_rate(url, "m", prompts, args.output_len, float("inf"), 0))
    after = cpu()
    tokens = result["total_output_tokens"]
    for name, label in (
        ("uvicorn", "HTTP/SSE thread"),
        ("vllm-engine-loop", "engine step thread"),
        ("MainThread", "benchmark client"),
    ):
        tid = ids[name]
        used = after.get(tid, 0.0) - before.get(tid, 0.0)
        print(f"{label}: {used * 1000 / tokens:.3f} ms CPU per generated token")
    total = sum(after.values()) - sum(before.get(k, 0.0) for k in after)
    print(
        f"whole process: {total * 1000 / tokens:.3f} ms CPU per generated token "
        f"({tokens} tokens, {result['output_throughput']:.1f} output tok/s)"
    )
    server.should_exit = True
    thread.join(timeout=30)
    engine.shutdown()


if __name__ == "__main__":
    main()
