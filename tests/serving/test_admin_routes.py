"""The admin routes of the OpenAI server at -pp 2 (mp), behind the API key: the layer split
shown (`GET /v1/admin/pipeline`) and changed while 32 clients stream
(`POST /v1/admin/reshape_pipeline`): every stream finishes with the text of a run without the
re-split; a bad body is a 400 naming `layer_split`; a full pipeline has nothing to grow back
(`POST /v1/admin/grow_pipeline`); no key, no admin."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.utils import tiny_models
from tests.utils.server_utils import ServerThread
from vllm import AsyncEngineArgs, AsyncLLMEngine

MODEL = "tiny"
KEY = "admin-test-key"
CLIENTS = 32
PROMPTS = [f"{tiny_models.PROMPTS[i % len(tiny_models.PROMPTS)]} {i}" for i in range(CLIENTS)]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_dirs) -> Iterator[ServerThread]:
    args = AsyncEngineArgs(
        model=tiny_model_dirs["llama-gqa-tied"],
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        served_model_name=MODEL,
        disable_log_requests=True,
    )
    srv = ServerThread(AsyncLLMEngine.from_engine_args(args), api_key=KEY)
    yield srv
    srv.stop()


async def stream_all(srv: ServerThread, chunks_seen: asyncio.Event | None = None) -> list[str]:
    """Every client's streamed text (greedy, 96 tokens), in client order; sets `chunks_seen`
    once 2 chunks per client have arrived. 96 tokens leave the re-split requested then ~94
    decode steps to land in: with 48, a fast run once finished every stream first (nothing
    in flight to recompute)."""
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=180)
    count = 0

    async def one(i: int) -> str:
        nonlocal count
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPTS[i],
            max_tokens=96,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts = []
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            count += 1
            if chunks_seen is not None and count >= 2 * CLIENTS:
                chunks_seen.set()
        return "".join(parts)

    try:
        return list(await asyncio.gather(*(one(i) for i in range(CLIENTS))))
    finally:
        await client.close()


def test_admin_routes_need_the_key(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/v1/admin/pipeline").status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert http.get("/v1/admin/pipeline", headers=wrong).status_code == 401
        resp = http.post("/v1/admin/reshape_pipeline", json={"layer_split": [1, 5]})
        assert resp.status_code == 401
        assert http.post("/v1/admin/grow_pipeline").status_code == 401
        view = http.get("/v1/admin/pipeline", headers=AUTH)
        assert view.status_code == 200
        body = view.json()
        # A full pipeline has nothing to grow back.
        grow = http.post("/v1/admin/grow_pipeline", headers=AUTH)
        assert grow.status_code == 200 and grow.json()["grown"] is False
    # Nothing was re-split by the refused call.
    assert body["pipeline_parallel_size"] == body["configured_pipeline_parallel_size"] == 2
    assert body["resizes"] == []
    assert body["layer_split"] == [3, 3]
    assert [s["layers"] for s in body["stages"]] == [[0, 3], [3, 6]]
    assert all(isinstance(s["pid"], int) for s in body["stages"])


@pytest.mark.parametrize(
    "body",
    [
        {"layer_split": [3, 4]},
        {"layer_split": [0, 6]},
        {"layer_split": [2, 2, 2]},
        {"layer_split": "3,3"},
        {"layer_split": [True, 5]},
        {"layer_split": [3.5, 2.5]},
        {},
        {"layer_split": [3, 3], "force": True},
    ],
)
def test_bad_reshape_body_is_a_400_naming_layer_split(server, body):
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as http:
        resp = http.post("/v1/admin/reshape_pipeline", json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()
        if "force" in body:
            assert error["param"] == "force"
        else:
            assert error["param"] == "layer_split", error
        assert http.get("/v1/admin/pipeline").json()["layer_split"] == [3, 3]


def test_reshape_while_clients_stream(server):
    reference = asyncio.run(stream_all(server))

    async def run() -> tuple[list[str], httpx.Response]:
        seen = asyncio.Event()
        streams = asyncio.ensure_future(stream_all(server, seen))
        await asyncio.wait_for(seen.wait(), 120)
        assert not streams.done()
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=AUTH) as http:
            resp = await http.post("/v1/admin/reshape_pipeline", json={"layer_split": [1, 5]})
        return await streams, resp

    texts, resp = asyncio.run(run())
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["old_split"] == [3, 3] and body["new_split"] == [1, 5]
    assert body["recomputed_requests"] > 0
    assert [s["layers"] for s in body["pipeline"]["stages"]] == [[0, 1], [1, 6]]
    assert texts == reference
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as http:
        back = http.post("/v1/admin/reshape_pipeline", json={"layer_split": [3, 3]})
        assert back.status_code == 200
        view = http.get("/v1/admin/pipeline").json()
    assert view["layer_split"] == [3, 3]
    assert [e["new_split"] for e in view["reshapes"]][-2:] == [[1, 5], [3, 3]]
