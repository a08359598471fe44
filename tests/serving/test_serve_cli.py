"""The server's command lines: `vllm serve MODEL` (vllm.scripts, the console script's entry)
in a subprocess on a free local port, and the api_server flag parser."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai

from tests.utils.server_utils import spawn, wait_until_healthy
from vllm.distributed.net_utils import get_open_port
from vllm.entrypoints.openai.api_server import make_arg_parser


def test_api_server_flags_include_the_engine_flags():
    args = make_arg_parser().parse_args(
        ["--model", "m", "-pp", "2", "-tp", "1", "--port", "9", "--api-key", "k",
         "--max-num-seqs", "8", "--enforce-eager", "--served-model-name", "x",
         "--disable-log-requests"]
    )  # fmt: skip
    assert (args.pipeline_parallel_size, args.tensor_parallel_size) == (2, 1)
    assert (args.port, args.api_key, args.max_num_seqs) == (9, ["k"], 8)  # nargs="+"
    assert args.enforce_eager and args.disable_log_requests and args.served_model_name == ["x"]


def test_vllm_serve_subprocess(tiny_model_dirs):
    port = get_open_port()
    cmd = [
        sys.executable, "-m", "vllm.scripts", "serve", tiny_model_dirs["opt-pre"],
        "--host", "127.0.0.1", "--port", str(port), "--kv-cache-space", "0.05",
        "--swap-space", "0.01", "--served-model-name", "tiny-opt", "opt-alias", "--api-key", "k",
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    proc = spawn(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, 300)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        # Several served names (vLLM's nargs="+"): all listed, the first is every root.
        cards = client.models.list().data
        assert [(m.id, m.root) for m in cards] == [
            ("tiny-opt", "tiny-opt"),
            ("opt-alias", "tiny-opt"),
        ]
        assert client.completions.create(model="opt-alias", prompt="Hi", max_tokens=2).choices
        out = client.completions.create(model="tiny-opt", prompt="Hello", max_tokens=5)
        assert out.usage.completion_tokens == 5
        # The key guards /metrics too (only /health and /version are open).
        assert httpx.get(url + "/metrics").status_code == 401
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer k"})
        assert "vllm:generation_tokens_total" in metrics.text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode is not None
