"""Hostile and careless requests against the real server, at PP = 1 and PP = 2 (mp and Ray).

Each finding of the hardening issue: the request gets its 400 / 413 (or is served), a stream
running meanwhile is unaffected (its longest gap between chunks printed and bounded), and
the server is healthy afterwards. Also: a request whose logits processor raises fails alone
(no stage replaced), the API key guards every route but /health and /version, and 20 large
/tokenize requests leave the server's memory within a bound."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.utils import tiny_models
from tests.utils.server_utils import ServerThread, start_server_process
from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from vllm.entrypoints.openai.bounded_work import ServerLimits
from vllm.entrypoints.openai.serving_chat import UNTRUSTED_TEMPLATE
from vllm.request_failure import RequestFailedError
from vllm.worker import cpu_memory
from vllm.worker.cpu_memory import keep_malloc_defaults_in_this_process

KIND = "llama-gqa-tied"
MODEL = "tiny"
SETTINGS = dict(kv_cache_space=0.05, swap_space=0.01)
BODY_LIMIT = 2 << 20
# A template that would run for hours: refused, or stopped by the render budget.
SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
STREAM_PROMPT = "The capital of France is"
# The longest pause a concurrent stream may see while the hostile request is handled: an
# engine step of the tiny model takes milliseconds, a stalled event loop took seconds.
MAX_GAP_S = 3.0


@pytest.fixture(
    scope="module", params=["pp1", "pp2-mp", pytest.param("pp2-ray", marks=pytest.mark.ray)]
)
def server(request, tiny_model_dirs) -> Iterator[ServerThread]:
    pp = 1 if request.param == "pp1" else 2
    backend = request.param.split("-")[1] if pp > 1 else None
    if backend == "ray":
        request.getfixturevalue("ray_session")
    # As `vllm serve` does: the API process keeps glibc's malloc settings even at PP=1.
    keep_malloc_defaults_in_this_process()
    args = AsyncEngineArgs(
        model=tiny_model_dirs[KIND],
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        served_model_name=MODEL,
        disable_log_requests=True,
        **SETTINGS,
    )
    limits = ServerLimits(max_request_body_bytes=BODY_LIMIT, chat_template_timeout_s=1.0)
    srv = ServerThread(AsyncLLMEngine.from_engine_args(args), limits=limits)
    srv.kind = request.param  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def post(srv: ServerThread, path: str, body: Any, **kw: Any) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \\udXXX, as a careless client's JSON would.
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(srv.url + path, content=json.dumps(body), headers=headers, timeout=60, **kw)


def assert_error(resp: httpx.Response, status: int, param: Any = None, text: str = "") -> dict:
    assert resp.status_code == status, resp.text[:500]
    error = resp.json()
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    assert text in error["message"], error["message"]
    return error


async def _stream_gaps(url: str, started: asyncio.Event) -> tuple[str, float]:
    """A greedy streamed completion: its text and the longest gap between two chunks."""
    body = {
        "model": MODEL,
        "prompt": STREAM_PROMPT,
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, gap, last = "", 0.0, None
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                if last is not None:
                    gap = max(gap, now - last)
                last = now
                started.set()
                text += json.loads(line[6:])["choices"][0]["text"]
    return text, gap


def while_streaming(srv: ServerThread, hostile: Any) -> Any:
    """Run `hostile(client)` while a stream runs; check the stream and the server after."""

    async def main() -> Any:
        started = asyncio.Event()
        stream = asyncio.create_task(_stream_gaps(srv.url, started))
        await asyncio.wait_for(started.wait(), 60)
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            result = await hostile(client)
        text, gap = await stream
        return result, text, gap

    result, text, gap = asyncio.run(main())
    print(f"{srv.kind}: concurrent stream's longest gap {gap:.3f} s")  # type: ignore[attr-defined]
    assert gap < MAX_GAP_S
    assert text == expected_stream_text(srv)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    return result


_expected: dict[int, str] = {}


def expected_stream_text(srv: ServerThread) -> str:
    """The stream's text when nothing else runs (computed once per server)."""
    key = id(srv)
    if key not in _expected:
        body = {"model": MODEL, "prompt": STREAM_PROMPT, "max_tokens": 48, "temperature": 0}
        body["ignore_eos"] = True
        _expected[key] = post(srv, "/v1/completions", body).json()["choices"][0]["text"]
    return _expected[key]


BAD_SAMPLING = [
    ({"top_k": 2**63}, "top_k", "int64"),
    ({"top_k": 2**64 + 5}, "top_k", "int64"),
    ({"seed": 2**64}, "seed", "int64"),
    ({"seed": -(2**63) - 1}, "seed", "int64"),
    ({"max_tokens": 10**6}, "max_tokens", "'max_tokens' or 'max_completion_tokens' is too large"),
    ({"max_tokens": None, "min_tokens": 10**9}, "min_tokens", "min_tokens is too large"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids", "int64"),
    ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens", "greater than max_model_len"),
    ({"prompt_logprobs": 2**63}, "prompt_logprobs", "int64"),
]


@pytest.mark.parametrize("extra,param,text", BAD_SAMPLING)
def test_out_of_range_parameter_is_a_400(server, extra, param, text):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **extra}
    assert_error(post(server, "/v1/completions", body), 400, param, text)


def test_engine_killing_values_refused_while_a_stream_runs(server):
    """top_k = 2^63 killed the engine (PP=1) or burnt the restart budget (PP=2)."""

    async def hostile(client: httpx.AsyncClient) -> list[httpx.Response]:
        bodies = [
            {"model": MODEL, "prompt": "Hi", "top_k": 2**63, "max_tokens": 4},
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "top_k": 2**63},
            {"model": MODEL, "prompt": "Hi", "seed": 2**64, "temperature": 1.0},
        ]
        paths = ["/v1/completions", "/v1/chat/completions", "/v1/completions"]
        return await asyncio.gather(*(client.post(p, json=b) for p, b in zip(paths, bodies)))

    for resp, param in zip(while_streaming(server, hostile), ["top_k", "top_k", "seed"]):
        assert_error(resp, 400, param)
    assert server.engine.engine.fault_events == []


def test_top_k_beyond_the_vocabulary_is_served_as_no_filter(server):
    body = {"model": MODEL, "prompt": STREAM_PROMPT, "max_tokens": 8, "temperature": 0}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    body.update(top_k=2**40, temperature=1e-6)
    assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == plain


def test_chat_parameter_edges(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    assert_error(
        post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 0}),
        400,
        "max_tokens",
        "at least 1",
    )
    lone = {**chat, "messages": [{"role": "user", "content": "bad \ud800 text"}]}
    assert_error(post(server, "/v1/chat/completions", lone), 400, "messages", "Unicode")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "x\udfff"}), 400)
    assert_error(post(server, "/tokenize", {"prompt": "\ud800"}), 400, "prompt", "Unicode")


def test_request_chat_template_refused_and_render_budget(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    async def hostile(client: httpx.AsyncClient) -> list[httpx.Response]:
        return await asyncio.gather(
            client.post("/v1/chat/completions", json={**chat, "chat_template": SLOW_TEMPLATE}),
            client.post("/tokenize", json={**chat, "chat_template": SLOW_TEMPLATE}),
        )

    for resp in while_streaming(server, hostile):
        assert_error(resp, 400, "chat_template", UNTRUSTED_TEMPLATE)
    # An operator who trusts request templates still gets the time budget (1 s here).
    trusting = ServerThread(
        server.engine,
        limits=ServerLimits(trust_request_chat_template=True, chat_template_timeout_s=1.0),
    )
    try:
        started = time.monotonic()
        resp = post(trusting, "/v1/chat/completions", {**chat, "chat_template": SLOW_TEMPLATE})
        assert_error(resp, 400, "messages", "took longer than 1 s")
        assert time.monotonic() - started < 10
        ok = post(trusting, "/v1/chat/completions", {**chat, "chat_template": "{{ 'A: ' }}"})
        assert ok.status_code == 200, ok.text
    finally:
        trusting.stop(shutdown_engine=False)


def test_big_inputs_refused_without_stalling_streams(server):
    cap = server_prompt_cap(server)

    async def hostile(client: httpx.AsyncClient) -> list[httpx.Response]:
        huge = "word " * (BODY_LIMIT // 4)  # over the body limit
        long_prompt = "a" * (cap + 1)  # under the body limit, over the prompt cap

        async def chunked() -> Any:  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(BODY_LIMIT // (64 << 10) + 2):
                yield b"a" * (64 << 10)
            yield b'"}'

        return await asyncio.gather(
            client.post("/tokenize", content=chunked()),
            client.post("/tokenize", json={"prompt": huge}),
            client.post("/v1/completions", json={"model": MODEL, "prompt": huge}),
            client.post("/tokenize", json={"prompt": long_prompt}),
            client.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt}),
            client.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 300}),
        )

    chunked, too_big, too_big_prompt, long_tok, long_prompt, many = while_streaming(server, hostile)
    assert_error(chunked, 413, text="--max-request-body-bytes")
    assert_error(too_big, 413, text="--max-request-body-bytes")
    assert_error(too_big_prompt, 413)
    assert_error(long_tok, 400, "prompt", "maximum context length")
    assert_error(long_prompt, 400, "prompt", "maximum context length")
    assert_error(many, 400, "prompt", "--max-prompts-per-request")


def test_large_tokenize_is_served_off_the_event_loop(server):
    """A /tokenize just under the cap is served, and /health answers meanwhile."""
    text = "hello world " * (server_prompt_cap(server) // 13)

    async def hostile(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        task = asyncio.create_task(client.post("/tokenize", json={"prompt": text}))
        worst = 0.0
        while not task.done():
            t0 = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            await asyncio.sleep(0.02)
        return await task, worst

    resp, worst = while_streaming(server, hostile)
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["count"] > 1000
    print(f"/health during a large /tokenize: worst {worst:.3f} s")
    assert worst < MAX_GAP_S


def server_prompt_cap(srv: ServerThread) -> int:
    return srv.server.config.app.state.work.max_prompt_chars


def test_failing_logits_processor_fails_only_its_request(server, tiny_model_dirs):
    """A processor that raises inside the last stage fails its request (the error names it);
    a concurrent request completes and equals HF; no stage is replaced."""
    engine: AsyncLLMEngine = server.engine
    prompt = tiny_models.PROMPTS[0]

    def boom(token_ids: list[int], logits: Any) -> Any:
        if len(token_ids) >= 3:
            raise ZeroDivisionError("processor bug")
        return logits

    async def run(request_id: str, params: SamplingParams) -> Any:
        final = None
        async for output in engine.generate(prompt, params, request_id):
            final = output
        return final

    async def main() -> list[Any]:
        good = SamplingParams(temperature=0, max_tokens=16)
        bad = SamplingParams(temperature=0, max_tokens=16, logits_processors=[boom])
        return await asyncio.gather(
            run("good-1", good), run("bad-1", bad), run("good-2", good), return_exceptions=True
        )

    good1, bad, good2 = asyncio.run(main())
    assert isinstance(bad, RequestFailedError), bad
    assert "bad-1" in str(bad) and "ZeroDivisionError" in str(bad)
    expected = tiny_models.hf_greedy(tiny_model_dirs[KIND], [prompt], 16)[0]
    for good in (good1, good2):
        assert list(good.outputs[0].token_ids) == expected
    assert engine.engine.fault_events == []
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_stage_processes_listen_on_no_wildcard_address(server):
    """Every listening socket of the stage processes (gloo's pairs, Ray's call sockets) is
    bound to a specific address, never 0.0.0.0 / ::; the ranks met through a file only this
    user can open, so there is no rendezvous port for a stranger to reach at all."""
    if server.kind == "pp1":  # type: ignore[attr-defined]
        pytest.skip("PP=1 runs no stage process and no rendezvous")
    infos = server.engine.engine.get_stage_infos()
    listening = []
    wildcard_per_process = []
    for info in infos:
        conns = psutil.Process(info.pid).net_connections("inet")
        mine = [c.laddr for c in conns if c.status == "LISTEN"]
        listening += mine
        wildcard_per_process.append(len([a for a in mine if a.ip in ("0.0.0.0", "::")]))
    kind = server.kind  # type: ignore[attr-defined]
    print(f"{kind}: stage listeners {[(a.ip, a.port) for a in listening]}")
    assert len(listening) >= len(infos)  # gloo's pairs (and on Ray the call sockets)
    directory = server.engine.engine.executor._rendezvous_dir
    assert directory is not None and stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert os.listdir(directory), "no FileStore in the rendezvous directory"
    # A Ray actor process also runs Ray's own core-worker server, on every interface (Ray's
    # choice, one per process); nothing of the engine's may add another.
    allowed = 1 if kind.endswith("ray") else 0
    assert all(n <= allowed for n in wildcard_per_process), listening


def test_health_reports_a_stopped_stage_between_steps(server):
    """A stage process stopped (SIGSTOP) while the engine is idle: /health says at once (no
    step has to run into it) that the server is degraded, naming the stage -- 200, since the
    next step replaces it -- and healthy again once the process runs (nothing replaced)."""
    if server.kind == "pp1":  # type: ignore[attr-defined]
        pytest.skip("PP=1 runs no stage process")
    info = server.engine.engine.get_stage_infos()[1]
    assert info.pid is not None
    resp = httpx.get(server.url + "/health", timeout=10)
    assert resp.status_code == 200 and resp.content == b"" and "X-Health-Status" not in resp.headers
    os.kill(info.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        resp = httpx.get(server.url + "/health", timeout=10)
        took = time.monotonic() - started
    finally:
        os.kill(info.pid, signal.SIGCONT)
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Health-Status"] == "degraded"
    body = resp.json()
    assert body["status"] == "degraded" and body["stages"] == [1]
    assert (
        "stage 1 (rank 1" in body["message"] and f"process {info.pid} is stopped" in body["message"]
    ), body
    assert took < 2.0
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health", timeout=10).content != b"":
        assert time.monotonic() < deadline, "still degraded after SIGCONT"
        time.sleep(0.1)
    faults = len(server.engine.engine.fault_events)
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert len(server.engine.engine.fault_events) == faults  # continued, not replaced


def test_api_key_guards_every_route(server):
    if server.kind != "pp1":  # type: ignore[attr-defined]
        pytest.skip("the routes are the same at every pipeline size")
    key = "s3cret-key"
    guarded = ServerThread(server.engine, api_key=key)
    try:
        url = guarded.url

        def get(path: str, **headers: str) -> int:
            return httpx.get(url + path, headers=headers, timeout=30).status_code

        for path in ("/v1/models", "/metrics", "/docs", "/openapi.json"):
            assert get(path) == 401, path
            assert get(path, Authorization=f"Bearer {key}x") == 401, path
        for path in ("/health", "/version"):
            assert get(path) == 200, path
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert get("/v1/models", Authorization=f"{scheme} {key}") == 200
        assert get("/v1/models", Authorization=f"Basic {key}") == 401
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(url + path, json=body, timeout=30).status_code == 401
            ok = httpx.post(
                url + path, json=body, headers={"Authorization": f"bearer {key}"}, timeout=30
            )
            assert ok.status_code == 200, ok.text
    finally:
        guarded.stop(shutdown_engine=False)
    opened = ServerThread(
        server.engine, api_key=key, limits=ServerLimits(allow_unauthenticated_metrics=True)
    )
    try:
        assert httpx.get(opened.url + "/metrics", timeout=30).status_code == 200
        assert httpx.get(opened.url + "/v1/models", timeout=30).status_code == 401
    finally:
        opened.stop(shutdown_engine=False)


def test_large_tokenize_requests_leave_memory_bounded(server):
    """20 /tokenize requests just under the prompt cap (and 20 prompts over it): the server
    process grows by less than a fixed bound (it grew ~0.5 GB per 10 MB request when the
    worker's malloc tuning reached it)."""
    if server.kind != "pp1":  # type: ignore[attr-defined]
        pytest.skip("the API process hosts the worker only at PP=1")
    text = "hello world " * (server_prompt_cap(server) // 13)
    proc = psutil.Process()
    post(server, "/tokenize", {"prompt": text})  # warm up the tokenizer's buffers
    before = proc.memory_info().rss
    for i in range(20):
        assert post(server, "/tokenize", {"prompt": text + str(i)}).status_code == 200
        resp = post(server, "/v1/completions", {"model": MODEL, "prompt": text * 2})
        assert resp.status_code == 400
    grown = (proc.memory_info().rss - before) / 2**20
    print(f"RSS after 20 large /tokenize + 20 refused prompts: {grown:+.1f} MiB")
    assert grown < 150
    # The cause of the old growth was the worker's malloc tuning (no mmap, no trim) applied in
    # the API process, which hosts the PP=1 worker: it must be off here. (What the tuning does
    # to freed memory is measured in a fresh process: tests/models/test_cpu_memory.py; here
    # the test session's own heap is too fragmented for a byte count to mean anything.)
    assert cpu_memory.tune_malloc() is False


def test_request_log_line_is_truncated(server, caplog):
    """A 1 MB stop list is served, and its request's log line stays short (--max-log-len)."""
    if server.kind != "pp1":  # type: ignore[attr-defined]
        pytest.skip("logging is the API process's, the same at every pipeline size")
    engine = server.engine
    engine.log_requests, engine.max_log_len = True, 200
    try:
        stop = ["zq" + str(i) for i in range(100_000)]
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stop": stop}
        with caplog.at_level("INFO", logger="vllm"):
            assert post(server, "/v1/completions", body).status_code == 200
    finally:
        engine.log_requests, engine.max_log_len = False, None
    lines = [r.getMessage() for r in caplog.records if "Received request" in r.getMessage()]
    assert lines and all(len(line) < 400 for line in lines), [len(x) for x in lines]
    assert "more characters" in lines[0]


def _start_server(model_dir: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    args = ["--kv-cache-space", "0.05", "--swap-space", "0.01", "--disable-log-requests"]
    return start_server_process(model_dir, MODEL, [*args, *extra])


async def _long_stream(url: str, index: int, started: asyncio.Event) -> str:
    """A stream far longer than the shutdown timeout: how it ended (finish or error type).
    With the decode fast path 16 streams of 400 tokens once all finished within 3 s of the
    first token, so the streams and their count leave no such margin any more."""
    body = {"model": MODEL, "prompt": f"Story {index}:", "max_tokens": 500, "ignore_eos": True}
    body.update(stream=True, temperature=0)
    ending = "cut"
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                started.set()
                chunk = json.loads(line[6:])
                if "choices" not in chunk:
                    ending = chunk.get("type", "error")
                elif chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    ending = chunk["choices"][0]["finish_reason"]
    return ending


@pytest.mark.slow  # a `vllm serve` process per backend (~20-40 s each)
@pytest.mark.parametrize(
    "backend", ["pp1", "pp2-mp", pytest.param("pp2-ray", marks=pytest.mark.ray)]
)
def test_sigterm_drains_within_the_timeout(tiny_model_dirs, backend):
    """SIGTERM with 32 streams in flight: new requests are refused, the streams get
    --shutdown-timeout seconds, then end with an InternalServerError event; the server and
    every process it started exit within the timeout (plus the engine's own shutdown)."""
    timeout_s = 1
    extra = ["--shutdown-timeout", str(timeout_s)]
    if backend != "pp1":
        extra += ["-pp", "2", "--distributed-executor-backend", backend.split("-")[1]]
    proc, url = _start_server(tiny_model_dirs[KIND], extra)
    children = psutil.Process(proc.pid).children(recursive=True)

    async def main() -> tuple[list[str], float]:
        started = asyncio.Event()
        streams = [asyncio.create_task(_long_stream(url, i, started)) for i in range(32)]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(timeout=10) as client:
            try:
                late = await client.post(url + "/v1/completions", json={"prompt": "x"})
                assert late.status_code == 503
            except httpx.TransportError:
                pass  # the listening socket is already closed: refused as well
        endings = await asyncio.gather(*streams)
        return endings, time.monotonic() - t0

    try:
        endings, drained_s = asyncio.run(main())
        proc.wait(timeout=60)
        exit_s = drained_s  # the streams end last but one; the process follows
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"{backend}: streams ended {drained_s:.1f} s after SIGTERM: {sorted(set(endings))}")
    assert set(endings) <= {"InternalServerError", "length"}
    assert "InternalServerError" in endings
    assert exit_s < timeout_s + 15
    assert proc.returncode is not None
    # Every process the server started is gone within 2 s of the server's exit.
    deadline = time.monotonic() + 2
    while (left := [c.pid for c in children if alive(c)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], f"processes left behind: {left}"


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_api_key_sources_and_limit_flags(tmp_path, monkeypatch):
    """The key from --api-key, else --api-key-file (out of `ps`), else VLLM_API_KEY; the
    limit flags reach ServerLimits."""
    from vllm.entrypoints.openai.api_server import (
        api_keys_from_args,
        limits_from_args,
        make_arg_parser,
    )

    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    parser = make_arg_parser()
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys_from_args(parser.parse_args(["--model", "m"])) == ["from-env"]
    args = parser.parse_args(["--model", "m", "--api-key-file", str(key_file)])
    assert api_keys_from_args(args) == ["from-file"]
    flag = parser.parse_args(["--model", "m", "--api-key", "flag"])
    assert api_keys_from_args(flag) == ["flag"]
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        api_keys_from_args(args)
    limits = limits_from_args(
        parser.parse_args(
            [
                "--model",
                "m",
                "--max-request-body-bytes",
                "10",
                "--trust-request-chat-template",
                "--shutdown-timeout",
                "7",
                "--chat-template-timeout",
                "0.5",
                "--allow-unauthenticated-metrics",
                "--max-prompts-per-request",
                "3",
            ]
        )  # fmt: skip
    )
    assert limits == ServerLimits(10, 3, True, 0.5, 7.0, True)
    assert ServerLimits().shutdown_timeout_s < 30
