"""What a stranger reaching the servers meets by default, on one tiny PP=1 engine.

- OpenAI server: the admin routes answer 403 naming the way to turn them on unless the server
  has an API key (then they need it) or VLLM_SERVER_DEV_MODE=1 (then they are open, with a
  WARNING at startup); the startup log says which optional routes are mounted. vLLM's TLS
  flags serve HTTPS with a certificate made here; bad TLS flags are a ValueError naming them.
- Legacy demo server (/generate), started from its own flags: HTTPS, the API key on every
  route but /health, the body limit (413), and a prompt larger than the context can hold is a
  400 naming `prompt` without stalling a stream running meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.utils import tiny_models
from tests.utils.server_utils import ServerThread
from tests.utils.tls_certs import self_signed
from vllm import AsyncEngineArgs, AsyncLLMEngine
from vllm.distributed.net_utils import get_open_port
from vllm.entrypoints import api_server as demo_server
from vllm.entrypoints.openai import api_server as openai_server
from vllm.entrypoints.tls import uvicorn_tls_kwargs

KIND = "llama-gqa-tied"
MODEL = "tiny"
KEY = "secure-defaults-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DEMO_BODY_LIMIT = 16 << 20
# The longest pause a stream may see while the huge prompt is handled: a step of the tiny model
# takes milliseconds; tokenizing the huge prompt on the engine thread took 5-60 s.
MAX_GAP_S = 3.0
# Far more characters than 512 context tokens can hold (the cap is ~166k for this tokenizer)
# and, tokenized, seconds of work: what a hostile client sends to stall the server.
HUGE_PROMPT = ("lorem ipsum dolor sit amet " * 80000)[:2_000_000]


@pytest.fixture(scope="module")
def engine(tiny_model_dirs) -> Iterator[AsyncLLMEngine]:
    args = AsyncEngineArgs(
        model=tiny_model_dirs[KIND],
        served_model_name=MODEL,
        disable_log_requests=True,
        kv_cache_space=0.05,
        swap_space=0.01,
    )
    built = AsyncLLMEngine.from_engine_args(args)
    yield built
    built.shutdown()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[str, str]:
    return self_signed(tmp_path_factory.mktemp("tls"))


class Captured(logging.Handler):
    """The records of the named loggers (at INFO and above) while the block runs."""

    def __init__(self, *names: str) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.loggers = [logging.getLogger(name) for name in names]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Captured:
        self.levels = [lg.level for lg in self.loggers]
        for lg in self.loggers:
            lg.addHandler(self)
            lg.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: Any) -> None:
        for lg, level in zip(self.loggers, self.levels):
            lg.removeHandler(self)
            lg.setLevel(level)

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


class Served:
    """uvicorn running `config` in a daemon thread until `stop()`."""

    def __init__(self, config: Any) -> None:
        import uvicorn

        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "not started"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _trusting(certfile: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=certfile)


ADMIN_CALLS = [
    ("GET", "/v1/admin/pipeline", None),
    ("POST", "/v1/admin/reshape_pipeline", {"layer_split": [1, 1]}),
    ("POST", "/v1/admin/grow_pipeline", None),
]


def test_admin_routes_need_a_key_or_dev_mode(engine, monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with Captured("vllm.entrypoints.openai.api_server") as log:
        srv = ServerThread(engine)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            for method, path, body in ADMIN_CALLS:
                resp = http.request(method, path, json=body)
                assert resp.status_code == 403, (path, resp.text)
                error = resp.json()
                assert error["type"] == "PermissionDeniedError" and error["code"] == 403
                assert "VLLM_SERVER_DEV_MODE=1" in error["message"]
                assert "--api-key" in error["message"]
            assert http.get("/v1/models").status_code == 200  # the rest is served
    finally:
        srv.stop(shutdown_engine=False)
    infos = [m for m in log.messages(logging.INFO) if m.startswith("Optional routes")]
    assert len(infos) == 1 and "admin (/v1/admin/*) off" in infos[0], log.messages(logging.INFO)

    # With a key they are mounted behind it, and there is nothing to warn about.
    with Captured("vllm.entrypoints.openai.admin") as log:
        srv = ServerThread(engine, api_key=KEY)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            assert http.get("/v1/admin/pipeline").status_code == 401
            assert http.get("/v1/admin/pipeline", headers=AUTH).status_code == 200
    finally:
        srv.stop(shutdown_engine=False)
    assert log.messages(logging.WARNING) == []


def test_dev_mode_mounts_the_admin_routes_with_a_warning(engine, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with Captured("vllm.entrypoints.openai.admin", "vllm.entrypoints.openai.api_server") as log:
        srv = ServerThread(engine)
    try:
        view = httpx.get(srv.url + "/v1/admin/pipeline", timeout=30)
        assert view.status_code == 200, view.text
        assert view.json()["pipeline_parallel_size"] == 1
    finally:
        srv.stop(shutdown_engine=False)
    warnings = log.messages(logging.WARNING)
    assert any("VLLM_SERVER_DEV_MODE=1 and no API key" in m for m in warnings), warnings
    assert any("admin (/v1/admin/*) mounted" in m for m in log.messages(logging.INFO))


def test_openai_server_serves_https_from_vllm_tls_flags(engine, certs):
    keyfile, certfile = certs
    args = openai_server.make_arg_parser().parse_args(
        ["--model", "unused", "--ssl-keyfile", keyfile, "--ssl-certfile", certfile]
    )
    import uvicorn

    port = get_open_port()
    config = uvicorn.Config(
        openai_server.build_app(engine),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        **uvicorn_tls_kwargs(args),
    )
    served = Served(config)
    try:
        resp = httpx.get(
            f"https://127.0.0.1:{port}/v1/models", verify=_trusting(certfile), timeout=30
        )
        assert resp.status_code == 200 and resp.json()["data"][0]["id"] == MODEL
        with pytest.raises(httpx.TransportError):  # no plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
    finally:
        served.stop()


def test_bad_tls_flags_name_the_flag(certs, tmp_path):
    keyfile, certfile = certs
    parser = openai_server.make_arg_parser()
    cases = {
        "--ssl-keyfile needs --ssl-certfile": ["--ssl-keyfile", keyfile],
        "--ssl-certfile": ["--ssl-certfile", str(tmp_path / "missing.pem")],
        "--ssl-cert-reqs": ["--ssl-certfile", certfile, "--ssl-cert-reqs", "7"],
    }
    for expected, flags in cases.items():
        with pytest.raises(ValueError, match=expected):
            uvicorn_tls_kwargs(parser.parse_args(["--model", "unused", *flags]))


@pytest.fixture(scope="module")
def demo(engine, certs) -> Iterator[str]:
    """The legacy server, configured from its own flags, on this engine; its https URL."""
    keyfile, certfile = certs
    port = get_open_port()
    args = demo_server.make_arg_parser().parse_args(
        [
            "--model", "unused", "--host", "127.0.0.1", "--port", str(port),
            "--api-key", KEY, "--max-request-body-bytes", str(DEMO_BODY_LIMIT),
            "--ssl-keyfile", keyfile, "--ssl-certfile", certfile, "--log-level", "warning",
        ]
    )  # fmt: skip
    app = asyncio.run(demo_server.init_app(args, engine))
    served = Served(demo_server.uvicorn_config(args, app))
    try:
        yield f"https://127.0.0.1:{port}"
    finally:
        served.stop()


def test_demo_server_needs_the_key_over_https(demo, certs):
    body = {"prompt": tiny_models.PROMPTS[0], "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=demo, verify=_trusting(certs[1]), timeout=60) as http:
        assert http.get("/health").status_code == 200  # open, for load balancers
        assert http.post("/generate", json=body).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert http.post("/generate", json=body, headers=wrong).status_code == 401
        resp = http.post("/generate", json=body, headers=AUTH)
        assert resp.status_code == 200, resp.text
        assert resp.json()["text"][0].startswith(tiny_models.PROMPTS[0])
        too_big = http.post(
            "/generate",
            content=json.dumps({"prompt": "x" * DEMO_BODY_LIMIT}),
            headers={**AUTH, "Content-Type": "application/json"},
        )
        assert too_big.status_code == 413
        assert "--max-request-body-bytes" in too_big.json()["message"]
        not_text = http.post("/generate", json={"prompt": 5}, headers=AUTH)
        assert not_text.status_code == 400, not_text.text
        ids = {"prompt_token_ids": [1, 2, 3]}  # token ids: nothing to tokenize, still served
        by_ids = http.post("/generate", json={"prompt": ids, "max_tokens": 2}, headers=AUTH)
        assert by_ids.status_code == 200 and len(by_ids.json()["text"]) == 1


def test_demo_server_refuses_a_huge_prompt_without_stalling_a_stream(demo, certs):
    ctx = _trusting(certs[1])

    async def run() -> tuple[httpx.Response, float, float, list[dict]]:
        async with httpx.AsyncClient(base_url=demo, verify=ctx, timeout=120) as http:
            gaps: list[float] = []
            parts: list[dict] = []
            huge_sent = asyncio.Event()

            async def stream() -> None:
                body = {
                    "prompt": tiny_models.PROMPTS[1],
                    "max_tokens": 200,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                async with http.stream("POST", "/generate", json=body, headers=AUTH) as r:
                    assert r.status_code == 200
                    last = time.monotonic()
                    buffer = b""
                    async for chunk in r.aiter_bytes():
                        now = time.monotonic()
                        if huge_sent.is_set():
                            gaps.append(now - last)
                        last = now
                        buffer += chunk
                    parts.extend(json.loads(p) for p in buffer.decode().split("\0") if p)

            streaming = asyncio.ensure_future(stream())
            await asyncio.sleep(0.3)  # the stream is running
            huge_sent.set()
            started = time.monotonic()
            huge = await http.post("/generate", json={"prompt": HUGE_PROMPT}, headers=AUTH)
            answered = time.monotonic() - started
            await streaming
            return huge, answered, max(gaps, default=0.0), parts

    huge, answered, worst_gap, parts = asyncio.run(run())
    assert huge.status_code == 400, huge.text[:300]
    message = huge.json()["error"]
    assert "prompt" in message and "maximum context length is 512 tokens" in message
    print(f"huge prompt answered in {answered:.2f} s; the stream's longest gap {worst_gap:.2f} s")
    assert worst_gap < MAX_GAP_S
    assert len(parts[-1]["text"]) == 1  # the stream ran to its end


def test_demo_server_refuses_a_prompt_over_the_context_in_tokens(demo, certs):
    """A prompt under the character cap but longer than the context in tokens (or given as
    token ids) is a 400 with the OpenAI server's message, not a request the engine ignores."""
    ctx = _trusting(certs[1])
    with httpx.Client(base_url=demo, verify=ctx, timeout=120) as http:
        text = http.post(
            "/generate", json={"prompt": "lorem ipsum " * 400, "max_tokens": 1}, headers=AUTH
        )
        ids = http.post(
            "/generate",
            json={"prompt": {"prompt_token_ids": [5] * 513}, "max_tokens": 1},
            headers=AUTH,
        )
    for answer in (text, ids):
        assert answer.status_code == 400, answer.text[:300]
        assert "maximum context length is 512 tokens" in answer.json()["error"]
