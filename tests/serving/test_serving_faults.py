"""The OpenAI server at -pp 2 (mp) serving through a stage kill: 32 streaming clients (the
async openai client) are mid-stream when a stage process is SIGKILLed; the stage is replaced,
every stream finishes with exactly the text of a fault-free run (greedy), and /health, polled
all along, says "degraded" (200) while the stage is replaced and never 503."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.utils import tiny_models
from tests.utils.server_utils import ServerThread
from vllm import AsyncEngineArgs, AsyncLLMEngine

# Stages are killed and replaced here: engines keep a warm spare, as in production (conftest).
WARM_SPARES = True

MODEL = "tiny"
CLIENTS = 32
MAX_TOKENS = 48
PROMPTS = [f"{tiny_models.PROMPTS[i % len(tiny_models.PROMPTS)]} {i}" for i in range(CLIENTS)]


@pytest.fixture(scope="module")
def server(tiny_model_dirs) -> Iterator[ServerThread]:
    args = AsyncEngineArgs(
        model=tiny_model_dirs["llama-gqa-tied"],
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        served_model_name=MODEL,
        disable_log_requests=True,
    )
    srv = ServerThread(AsyncLLMEngine.from_engine_args(args))
    yield srv
    srv.stop()


async def stream_all(srv: ServerThread, on_chunk: Callable[[int], None]) -> list[str]:
    """Every client's streamed text, in client order; `on_chunk(total chunks so far)`."""
    client = openai.AsyncOpenAI(
        base_url=srv.url + "/v1", api_key="EMPTY", max_retries=0, timeout=180
    )
    chunks = 0

    async def one(i: int) -> str:
        nonlocal chunks
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPTS[i],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts = []
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            chunks += 1
            on_chunk(chunks)
        return "".join(parts)

    try:
        return list(await asyncio.gather(*(one(i) for i in range(CLIENTS))))
    finally:
        await client.close()


async def poll_health(url: str, done: asyncio.Event) -> list[tuple[int, str]]:
    """(status, X-Health-Status) of /health every 20 ms until `done`."""
    seen = []
    async with httpx.AsyncClient(timeout=30) as http:
        while not done.is_set():
            resp = await http.get(url + "/health")
            seen.append((resp.status_code, resp.headers.get("X-Health-Status", "healthy")))
            await asyncio.sleep(0.02)
    return seen


def test_streams_survive_a_stage_kill_and_health_says_degraded(server):
    engine = server.engine.engine
    reference = asyncio.run(stream_all(server, lambda n: None))
    assert all(reference) and len(set(reference)) > 1

    killed: list[int] = []

    def kill_mid_stream(chunks: int) -> None:
        # Every stream has started (and some are well into their text) when the stage dies.
        if chunks >= CLIENTS * 4 and not killed:
            pid = engine.get_stage_infos()[1].pid
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    async def main() -> tuple[list[str], list[tuple[int, str]]]:
        done = asyncio.Event()
        poller = asyncio.create_task(poll_health(server.url, done))
        try:
            texts = await stream_all(server, kill_mid_stream)
        finally:
            done.set()
        return texts, await poller

    faults_before = len(engine.fault_events)
    started = time.monotonic()
    texts, health = asyncio.run(main())
    print(
        f"{CLIENTS} streams through a stage kill in {time.monotonic() - started:.1f} s; "
        f"/health polled {len(health)} times: "
        f"{sum(h == 'degraded' for _, h in health)} degraded, "
        f"{sum(s == 503 for s, _ in health)} 503"
    )
    assert killed, "the stage was never killed"
    events = engine.fault_events[faults_before:]
    assert len(events) == 1 and events[0].ranks == [1] and events[0].recovery_s is not None
    assert texts == reference
    assert all(status == 200 for status, _ in health), health
    assert any(state == "degraded" for _, state in health)
    assert health[-1] == (200, "healthy")
