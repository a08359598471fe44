"""vLLM's legacy demo server, `python -m vllm.entrypoints.api_server`, in a subprocess on a
free local port: /generate whole and streamed (NUL-separated JSON) equal `LLM.generate`,
/health, bad parameters, and a client that leaves mid-stream aborts its request."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.utils import tiny_models
from tests.utils.server_utils import spawn, wait_until_healthy
from vllm import LLM, SamplingParams
from vllm.distributed.net_utils import get_open_port

KIND = "llama-gqa-tied"
SETTINGS = ["--kv-cache-space", "0.05", "--swap-space", "0.01"]


@pytest.fixture(scope="module")
def demo(tiny_model_dirs):
    port = get_open_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.api_server", "--model",
        tiny_model_dirs[KIND], "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", *SETTINGS,
    ]  # fmt: skip
    proc = spawn(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, 300)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    llm = LLM(tiny_model_dirs[KIND], kv_cache_space=0.05, swap_space=0.01)
    yield llm
    llm.shutdown()


def test_generate_whole_and_streamed(demo, reference):
    prompt = tiny_models.PROMPTS[2]
    expected = (
        reference.generate(
            prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(demo + "/generate", json=body, timeout=60)
    assert whole.status_code == 200
    assert whole.json() == {"text": [prompt + expected]}
    with httpx.stream("POST", demo + "/generate", json={**body, "stream": True}, timeout=60) as r:
        raw = b"".join(r.iter_bytes())
    parts = [json.loads(p) for p in raw.decode().split("\0") if p]
    assert len(parts) > 1  # updates as tokens come
    assert all(p["text"][0].startswith(prompt) for p in parts)
    assert parts[-1] == {"text": [prompt + expected]}
    # n outputs, one text each.
    many = httpx.post(
        demo + "/generate",
        json={"prompt": "Hello", "n": 3, "temperature": 1.0, "seed": 0, "max_tokens": 4},
        timeout=60,
    ).json()["text"]
    assert len(many) == 3 and all(t.startswith("Hello") for t in many)


def test_health_and_bad_requests(demo):
    assert httpx.get(demo + "/health").status_code == 200
    bad = httpx.post(demo + "/generate", json={"prompt": "x", "temperature": -1}, timeout=30)
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]
    unknown = httpx.post(demo + "/generate", json={"prompt": "x", "bogus": 1}, timeout=30)
    assert unknown.status_code == 400 and "bogus" in unknown.json()["error"]
    assert httpx.post(demo + "/generate", json={"max_tokens": 2}, timeout=30).status_code == 400


def test_client_leaving_aborts(tiny_model_dirs):
    """In this process, as vLLM's own test drives the demo server: an engine subclass counts
    aborts through `_engine_abort`, set as the module's `engine`; leaving a stream aborts."""
    import threading

    import uvicorn

    from vllm import AsyncEngineArgs, AsyncLLMEngine
    from vllm.entrypoints import api_server
    from vllm.utils import FlexibleArgumentParser

    class CountingEngine(AsyncLLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.num_aborts = 0

        async def _engine_abort(self, request_ids):
            ids = list(request_ids)
            self.num_aborts += len(ids)
            await super()._engine_abort(ids)

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--model", tiny_model_dirs[KIND], "--tokenizer_pool_size", "0", *SETTINGS]
    )
    engine = CountingEngine.from_engine_args(AsyncEngineArgs.from_cli_args(args))
    api_server.engine = engine
    port = get_open_port()
    config = uvicorn.Config(api_server.app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        assert (
            httpx.post(url + "/generate", json={"prompt": "B", "max_tokens": 2}).status_code == 200
        )
        assert engine.num_aborts == 0
        body = {"prompt": "A", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            next(r.iter_bytes())  # the first update arrived; leave now
        deadline = time.time() + 30
        while engine.num_aborts == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert engine.num_aborts == 1
        while engine.engine.has_unfinished_requests() and time.time() < deadline:
            time.sleep(0.05)
        assert not engine.engine.has_unfinished_requests()
        quick = httpx.post(url + "/generate", json={"prompt": "B", "max_tokens": 2}, timeout=60)
        assert quick.status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
        api_server.engine = None


def test_vllm_05_engine_flags():
    from vllm import AsyncEngineArgs
    from vllm.utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--model", "m", "--worker-use-ray", "--engine_use_ray", "--max_num_seqs=8"]
    )
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.worker_use_ray and engine_args.engine_use_ray
    assert engine_args.max_num_seqs == 8 and engine_args.tokenizer_pool_size == 0
