"""vLLM's test_shutdown_on_engine_failure, here: the server started the way that test starts
vLLM's (its flags, SIGINT ignored) comes up and answers; when its engine dies (its stage
process killed, no restart allowed) the request that finds it dead gets a 500, and
the server shuts down by itself (exit status 1), as vLLM's does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from tests.utils.server_utils import ROOT
from vllm.distributed.net_utils import get_open_port

START_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 60.0


@pytest.fixture
def server(tiny_model_dirs):
    port = get_open_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", tiny_model_dirs["llama-gqa-tied"], "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        # vLLM's test's flags, as it passes them.
        "--dtype", "bfloat16", "--max-model-len", "128", "--enforce-eager",
        "--gpu-memory-utilization", "0.05", "--max-num-seqs", "2",
        "--disable-frontend-multiprocessing",
        # The stage in a process of its own, to be killed, and no restart for it.
        "--distributed-executor-backend", "mp", "--max-stage-restarts", "0",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "VLLM_LOGGING_LEVEL": "WARNING"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def test_server_shuts_down_when_its_engine_dies(server):
    proc, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=30)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:  # vLLM's readiness check: a completion goes through
        assert proc.poll() is None, f"the server exited with {proc.returncode} while starting"
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            client.completions.create(model="tiny", prompt="Hello", max_tokens=1)
            break
        except openai.OpenAIError:
            time.sleep(0.5)
    assert httpx.get(url + "/health", timeout=10).status_code == 200

    stages = psutil.Process(proc.pid).children()
    workers = [p for p in stages if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) == 1, [p.cmdline() for p in stages]
    for worker in workers:
        worker.kill()

    with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):
        client.completions.create(model="tiny", prompt="This should fail", max_tokens=1)
    assert proc.wait(timeout=EXIT_TIMEOUT_S) == 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)
