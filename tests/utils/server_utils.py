"""Run the OpenAI server on a free local port: in a thread of the test process
(`ServerThread`), or as its own process the way users start it (`start_server_process`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from vllm.distributed.net_utils import get_open_port
from vllm.engine.async_llm_engine import AsyncLLMEngine


class ServerThread:
    """uvicorn serving `build_app(engine)` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, engine: AsyncLLMEngine, api_key: str | None = None, **kw: Any):
        import uvicorn

        from vllm.entrypoints.openai.api_server import build_app

        self.engine = engine
        self.port = get_open_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_app(engine, api_key=api_key, **kw)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    def client(self, api_key: str = "EMPTY", **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kw)

    def stop(self, shutdown_engine: bool = True) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        if shutdown_engine:
            self.engine.shutdown()


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_server_process(
    model_dir: str, served_model_name: str, args: list[str], timeout_s: float = 240.0
) -> tuple[subprocess.Popen, str]:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1:<free port> with `args`;
    returns (the process, its URL) once `/health` answers 200."""
    port = get_open_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_model_name,
        "--uvicorn-log-level", "warning", *args,
    ]  # fmt: skip
    proc = spawn(cmd)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, timeout_s)
    return proc, url


def spawn(cmd: list[str]) -> subprocess.Popen:
    """A server command run from the repository root, importing this checkout's vllm."""
    env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_LOGGING_LEVEL": "WARNING"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 240.0) -> None:
    """Until `url`/health answers 200; fails if the process exits or the time runs out."""
    deadline = time.time() + timeout_s
    while True:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        assert time.time() < deadline, "server did not become healthy"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def tiny_openai_server(request: Any, model_dir: str, served_name: str, **settings: Any) -> Any:
    """A module's OpenAI server thread on `model_dir` at the fixture's PP (`request.param`, Ray
    for PP > 1), with stats on; yields it and stops it (a generator for a fixture)."""
    from vllm import AsyncEngineArgs

    pp = request.param
    if pp > 1:
        request.getfixturevalue("ray_session")
    args = AsyncEngineArgs(
        model=model_dir,
        pipeline_parallel_size=pp,
        served_model_name=served_name,
        disable_log_stats=False,
        disable_log_requests=True,
        **settings,
    )
    srv = ServerThread(AsyncLLMEngine.from_engine_args(args))
    yield srv
    srv.stop()
