"""Batch jobs: `vllm run-batch` (offline, PP = 1 and 2) and the online `/v1/files` +
`/v1/batches` (the official `openai` client), including a server SIGTERMed in the middle of a
batch and restarted on the same state directory, cancel, expiry, and the cap that keeps batch
lines from starving interactive requests.

Every successful line must equal the server's own `/v1/completions` (or chat) answer to the
same body (greedy), every bad line must get its own error line with the server's message, and
every custom_id must appear exactly once."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from tests.utils import tiny_models
from tests.utils.server_utils import ROOT, ServerThread, start_server_process
from vllm import AsyncEngineArgs, AsyncLLMEngine
from vllm.entrypoints.openai.batch_store import BatchStore
from vllm.entrypoints.openai.batches import parse_completion_window, parse_multipart

KIND = "llama-gqa-tied"
MODEL = "tiny"
SETTINGS = ["--kv-cache-space", "0.05", "--swap-space", "0.01", "--disable-log-requests"]
MAX_NUM_SEQS = 8
BATCH_CAP = 2  # --batch-max-concurrency of the shared server
DONE = ("completed", "failed", "cancelled", "expired")


def completion_body(i: int, max_tokens: int = 0, **extra: Any) -> dict[str, Any]:
    prompt = f"{tiny_models.PROMPTS[i % len(tiny_models.PROMPTS)]} {i}"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens or 4 + i % 5}
    return {**body, "temperature": 0, **extra}


def chat_body(i: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}


def line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# The kinds of bad line, by position in a cycle of 20.
BAD = {
    3: "bad-json",
    7: "bad-url",
    11: "bad-param",
    13: "bad-type",
    17: "embeddings",
    19: "stream",
}


def batch_lines(n: int, chat: bool) -> list[str]:
    """`n` lines: completions (and, with `chat`, chat) requests with every kind of bad line."""
    lines = []
    for i in range(n):
        kind = BAD.get(i % 20)
        cid = f"req-{i}"
        if kind == "bad-json":
            lines.append(line(cid, "/v1/completions", completion_body(i))[:40])  # cut short
        elif kind == "bad-url":
            lines.append(line(cid, "/v1/unknown", completion_body(i)))
        elif kind == "bad-param":
            lines.append(line(cid, "/v1/completions", completion_body(i, temperature=-1)))
        elif kind == "bad-type":
            lines.append(line(cid, "/v1/completions", completion_body(i, n="many")))
        elif kind == "embeddings":
            lines.append(line(cid, "/v1/embeddings", {"model": MODEL, "input": "x"}))
        elif kind == "stream":
            lines.append(line(cid, "/v1/completions", completion_body(i, stream=True)))
        elif chat and i % 4 == 1:
            lines.append(line(cid, "/v1/chat/completions", chat_body(i)))
        else:
            lines.append(line(cid, "/v1/completions", completion_body(i)))
    return lines


def read_jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(row) for row in text.splitlines() if row.strip()]


def check_outputs(outputs: list[dict[str, Any]], n: int, chat: bool) -> None:
    """One output per input line, in input order, each with the status its kind calls for."""
    assert len(outputs) == n
    for i, out in enumerate(outputs):
        kind = BAD.get(i % 20)
        if kind == "bad-json":
            assert out["custom_id"] is None
            assert f"Line {i + 1} is not valid JSON" in out["error"]["message"]
            continue
        assert out["custom_id"] == f"req-{i}"
        if kind is None:
            assert out["error"] is None, out
            assert out["response"]["status_code"] == 200
            body = out["response"]["body"]
            wanted = "chat.completion" if chat and i % 4 == 1 else "text_completion"
            assert body["object"] == wanted
        else:
            assert out["response"]["body"] is None
            assert out["response"]["status_code"] == 400, out
            assert out["error"]["code"] == 400
            param = {"bad-param": "temperature", "bad-type": "n", "stream": "stream"}
            assert out["error"]["param"] == param.get(kind, "url"), out


def choice_text(out: dict[str, Any]) -> str:
    choice = out["response"]["body"]["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    """One in-process server (PP=1), its batch lines capped at BATCH_CAP of MAX_NUM_SEQS."""
    args = AsyncEngineArgs(
        model=tiny_model_dirs[KIND],
        served_model_name=MODEL,
        disable_log_requests=True,
        kv_cache_space=0.05,
        swap_space=0.01,
        max_num_seqs=MAX_NUM_SEQS,
    )
    state = str(tmp_path_factory.mktemp("batch_state"))
    srv = ServerThread(
        AsyncLLMEngine.from_engine_args(args),
        batch_state_dir=state,
        batch_max_concurrency=BATCH_CAP,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("run_batch") / "requests.jsonl"
    path.write_text("\n".join(batch_lines(200, chat=True)) + "\n")
    return str(path)


def run_cli(args: list[str], timeout: float = 600) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    # Exit status 1: the file has lines that are not batch requests (invalid JSON); all the
    # lines have their output all the same.
    assert proc.returncode == 1, proc.stderr[-3000:]
    logs = proc.stdout + proc.stderr
    assert "10 line(s) of" in logs and "are not batch requests" in logs, logs[-3000:]
    assert "Running batch: 100% Completed | 200/200" in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def cli_outputs(tiny_model_dirs, batch_file, tmp_path_factory) -> dict[int, list[dict]]:
    """pp -> the output lines of run-batch on the 200-line file: PP=1 through `vllm
    run-batch`, PP=2 (mp) through `python -m vllm.entrypoints.openai.run_batch`."""
    out_dir = tmp_path_factory.mktemp("run_batch_out")
    results = {}
    for pp in (1, 2):
        out = str(out_dir / f"pp{pp}.jsonl")
        entry = (
            ["-m", "vllm.scripts", "run-batch"]
            if pp == 1
            else ["-m", "vllm.entrypoints.openai.run_batch"]
        )
        flags = ["-i", batch_file, "-o", out, "--model", tiny_model_dirs[KIND]]
        flags += ["--served-model-name", MODEL, *SETTINGS]
        if pp == 2:
            flags += ["--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp"]
        run_cli([*entry, *flags])
        with open(out, encoding="utf-8") as f:
            results[pp] = read_jsonl(f.read())
    return results


@pytest.mark.parametrize("pp", [1, 2], ids=["pp1", "pp2"])
def test_run_batch_cli(pp, cli_outputs, server):
    """200 lines with bad ones: one output per line, in order; bad lines get the server's
    400; good lines equal the server's answer to the same body (greedy), at PP=1 and PP=2."""
    outputs = cli_outputs[pp]
    check_outputs(outputs, 200, chat=True)
    client = server.client()
    lines = batch_lines(200, chat=True)
    for i in (0, 1, 2, 5, 40, 121, 198):  # completions and chat lines
        request = json.loads(lines[i])
        if request["url"] == "/v1/completions":
            answer = client.completions.create(**request["body"])
            assert choice_text(outputs[i]) == answer.choices[0].text
        else:
            chat = client.chat.completions.create(**request["body"])
            assert choice_text(outputs[i]) == chat.choices[0].message.content
        usage = outputs[i]["response"]["body"]["usage"]
        assert usage["completion_tokens"] == request["body"]["max_tokens"]
    # An invalid parameter: the same message as the server's 400.
    body = json.loads(lines[11])["body"]
    response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == 400
    assert outputs[11]["error"]["message"] == response.json()["message"]
    if pp == 2:  # the pipeline changes nothing: every line as at PP=1
        for one, two in zip(cli_outputs[1], outputs):
            if one["error"] is None:
                assert choice_text(one) == choice_text(two)


def test_run_batch_exit_status_and_vllm_schema(server, tmp_path):
    """vLLM's run_batch checks: an empty file gives an empty output; every output line
    validates as `protocol.BatchRequestOutput`; a line without custom_id is a malformed file
    (MalformedBatchError, exit status 1) yet the other lines ran."""
    import argparse
    import asyncio

    from vllm.entrypoints.openai.protocol import BatchRequestOutput
    from vllm.entrypoints.openai.run_batch import MalformedBatchError, make_arg_parser, run_batch

    def run(text: str) -> list[dict[str, Any]]:
        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text(text)
        flags = ["-i", str(src), "-o", str(out), "--model", "x", "--served-model-name", MODEL]
        args: argparse.Namespace = make_arg_parser().parse_args(flags)
        asyncio.run(run_batch(server.engine, args))
        return [json.loads(row) for row in out.read_text().splitlines()]

    assert run("") == []
    clean = batch_lines(20, chat=True)
    clean = [row for i, row in enumerate(clean) if BAD.get(i) != "bad-json"]
    outputs = run("\n\n".join(clean) + "\n")
    assert len(outputs) == 19
    for out in outputs:
        BatchRequestOutput.model_validate(out)
    no_id = json.dumps({"method": "POST", "url": "/v1/completions", "body": completion_body(1)})
    with pytest.raises(MalformedBatchError, match="1 line"):
        run(no_id + "\n" + clean[0] + "\n")
    outputs = [json.loads(row) for row in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert outputs[0]["error"]["param"] == "custom_id"
    assert outputs[1]["custom_id"] == "req-0" and outputs[1]["error"] is None


def wait_batch(client: Any, batch_id: str, timeout: float = 300) -> Any:
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in DONE:
            return batch
        assert time.time() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)


def test_batches_end_to_end(server, cli_outputs):
    """Upload, create, poll, download: the output and error files hold every line once, in
    input order, the same as run-batch's; files and batches list, retrieve and delete."""
    client = server.client()
    lines = batch_lines(200, chat=False)
    data = ("\n".join(lines) + "\n").encode()
    upload = client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert upload.bytes == len(data) and upload.purpose == "batch"
    assert client.files.content(upload.id).content == data
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata={"job": "e2e"},
    )
    assert batch.status in ("validating", "in_progress")
    assert batch.metadata == {"job": "e2e"}
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    good = [i for i in range(200) if i % 20 not in BAD]
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (200, len(good), 200 - len(good))
    ok = read_jsonl(client.files.content(batch.output_file_id).text)
    errors = read_jsonl(client.files.content(batch.error_file_id).text)
    assert [o["custom_id"] for o in ok] == [f"req-{i}" for i in good]
    by_line = {int(o["custom_id"][4:]): o for o in ok}
    for e in errors:
        if e["custom_id"] is not None:
            by_line[int(e["custom_id"][4:])] = e
        else:  # the invalid-JSON lines, by their line number
            by_line[int(e["error"]["message"].split()[1]) - 1] = e
    check_outputs([by_line[i] for i in range(200)], 200, chat=False)
    for i in good:  # the same text as run-batch's (and so as /v1/completions')
        if i % 4 == 1:
            continue  # a chat line in run-batch's file
        assert choice_text(by_line[i]) == choice_text(cli_outputs[1][i])

    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    ids = {f.id for f in client.files.list().data}
    assert {upload.id, batch.output_file_id, batch.error_file_id} <= ids
    assert batch.id in {b.id for b in client.batches.list().data}
    assert client.files.delete(upload.id).deleted
    with pytest.raises(Exception, match="No such File"):
        client.files.retrieve(upload.id)
    # The batch kept its own copy of the input: it stays readable.
    assert client.batches.retrieve(batch.id).status == "completed"


def test_batches_refuse_bad_jobs(server):
    """400s naming the parameter: an unknown endpoint, embeddings, a bad window, a missing
    file, a file of another purpose; a batch of no lines fails with empty_file."""
    import openai

    client = server.client()
    upload = client.files.create(file=("x.jsonl", b"\n"), purpose="batch")
    cases = [
        (dict(endpoint="/v1/embeddings"), "endpoint"),
        (dict(endpoint="/v1/moderations"), "endpoint"),
        (dict(completion_window="tomorrow"), "completion_window"),
        (dict(input_file_id="file-nope"), "input_file_id"),
    ]
    for change, param in cases:
        params = dict(input_file_id=upload.id, endpoint="/v1/completions")
        params.update(completion_window="24h")
        params.update(change)
        with pytest.raises(openai.APIStatusError) as info:
            client.batches.create(**params)
        assert info.value.body["param"] == param, info.value.body
    response = httpx.post(
        server.url + "/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "x"}
    )
    assert response.status_code == 400 and response.json()["param"] == "purpose"
    empty = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    empty = wait_batch(client, empty.id)
    assert empty.status == "failed" and empty.errors.data[0].code == "empty_file"


def long_lines(n: int, max_tokens: int, prefix: str = "long") -> bytes:
    rows = [
        line(f"{prefix}-{i}", "/v1/completions", completion_body(i, max_tokens, ignore_eos=True))
        for i in range(n)
    ]
    return ("\n".join(rows) + "\n").encode()


def test_cancel_and_interactive_not_starved(server):
    """While a long batch runs, an interactive request is answered at once (the batch holds
    at most BATCH_CAP of the MAX_NUM_SEQS slots); cancel ends the batch with the lines done
    so far in its output file."""
    client = server.client()
    n = 40
    upload = client.files.create(file=("long.jsonl", long_lines(n, 48)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.time() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.time() < deadline
        time.sleep(0.1)
    # Without the cap, FCFS would queue this behind the ~39 batch lines still waiting.
    answer = client.completions.create(**completion_body(5, 4))
    assert answer.choices[0].finish_reason == "length"
    progress = client.batches.retrieve(batch.id).request_counts
    assert progress.completed <= n // 2, progress
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert 1 <= batch.request_counts.completed < n
    done = read_jsonl(client.files.content(batch.output_file_id).text)
    assert len(done) == batch.request_counts.completed
    assert len({o["custom_id"] for o in done}) == len(done)
    with pytest.raises(Exception, match="Cannot cancel a batch with status 'cancelled'"):
        client.batches.cancel(batch.id)


def test_batch_expires(server):
    """A batch still running when its completion_window ends is expired: finished lines in
    the output file, the others `batch_expired` lines in the error file."""
    client = server.client()
    n = 24
    # Two short lines (done in well under a second), then lines that take seconds.
    data = long_lines(2, 2, "exp-short") + long_lines(n - 2, 128, "exp")
    upload = client.files.create(file=("exp.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/completions",
        completion_window="2s",  # type: ignore[arg-type]
    )
    batch = wait_batch(client, batch.id)
    assert batch.status == "expired" and batch.expired_at
    errors = read_jsonl(client.files.content(batch.error_file_id).text)
    assert errors and all(e["error"]["code"] == "batch_expired" for e in errors)
    ok = read_jsonl(client.files.content(batch.output_file_id).text)
    assert {"exp-short-0", "exp-short-1"} <= {o["custom_id"] for o in ok}
    assert batch.request_counts.completed == len(ok) and batch.request_counts.failed == len(errors)
    wanted = [f"exp-short-{i}" for i in range(2)] + [f"exp-{i}" for i in range(n - 2)]
    assert sorted(o["custom_id"] for o in ok + errors) == sorted(wanted)


def _start_server(
    model_dir: str, state_dir: str, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    args = ["--batch-state-dir", state_dir, "--batch-max-concurrency", "4", *SETTINGS, *extra]
    return start_server_process(model_dir, MODEL, args)


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)


def _stop(proc: subprocess.Popen) -> int | None:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # two server processes
def test_sigterm_and_restart_resume_exactly_once(tiny_model_dirs, tmp_path, server):
    """A server (PP=2, mp) SIGTERMed in the middle of a batch and restarted (PP=1) on the
    same state directory finishes it: every custom_id exactly once in the output, each
    line's text the one the server gives for its body."""
    state = str(tmp_path / "state")
    n = 60
    data = long_lines(n, 24, "r")
    pp2 = ("--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp")
    proc, url = _start_server(tiny_model_dirs[KIND], state, pp2)
    try:
        client = _client(url)
        upload = client.files.create(file=("r.jsonl", data), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.time() + 240
        while client.batches.retrieve(batch.id).request_counts.completed < 8:
            assert time.time() < deadline
            time.sleep(0.05)
        assert _stop(proc) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    journal = BatchStore(state).load_results(batch.id)
    print(f"{len(journal)} of {n} lines recorded before SIGTERM")
    assert 8 <= len(journal) < n, f"{len(journal)} lines recorded before SIGTERM"

    proc, url = _start_server(tiny_model_dirs[KIND], state)
    try:
        client = _client(url)
        resumed = wait_batch(client, batch.id)
        assert resumed.status == "completed", resumed
        assert resumed.request_counts.completed == n and resumed.request_counts.failed == 0
        outputs = read_jsonl(client.files.content(resumed.output_file_id).text)
        assert _stop(proc) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [o["custom_id"] for o in outputs] == [f"r-{i}" for i in range(n)]
    # No line ran twice: the journal holds each line once (a rerun line would be recorded again).
    with open(BatchStore(state).results_path(batch.id), encoding="utf-8") as f:
        recorded = [json.loads(row)["line"] for row in f]
    assert sorted(recorded) == list(range(n))
    for i in (0, 1, n // 2, n - 1):
        body = json.loads(data.decode().splitlines()[i])["body"]
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert choice_text(outputs[i]) == answer["choices"][0]["text"]


def test_helpers(tmp_path):
    """The multipart reader keeps bytes exact; completion windows; a torn journal record
    (a crash mid-write) is ignored, so its line runs again."""
    payload = b'{"a": 1}\r\n{"b": 2}\n\x00\xff end'
    request = httpx.Request(
        "POST", "http://x", files={"file": ("f.jsonl", payload)}, data={"purpose": "batch"}
    )
    body = request.read()
    fields = parse_multipart(request.headers["content-type"], body)
    assert fields["file"] == ("f.jsonl", payload)
    assert fields["purpose"] == (None, b"batch")
    assert parse_completion_window("24h") == 86400
    assert parse_completion_window("90s") == 90
    for bad in ("0h", "24", "1d", None):
        with pytest.raises(ValueError, match="completion_window"):
            parse_completion_window(bad)
    store = BatchStore(str(tmp_path))
    store.append_result("b", 0, {"x": 0})
    store.append_result("b", 2, {"x": 2})
    with open(store.results_path("b"), "a", encoding="utf-8") as f:
        f.write('{"line": 1, "out')
    assert store.load_results("b") == {0: {"x": 0}, 2: {"x": 2}}


def test_api_key_and_one_server_per_state_dir(server, tmp_path):
    """The batch routes sit behind --api-key like every /v1 route; a second server on a state
    directory in use answers 503 on them instead of running the same batches twice."""
    key = "batch-key"
    guarded = ServerThread(server.engine, api_key=key, batch_state_dir=str(tmp_path / "own"))
    try:
        assert httpx.get(guarded.url + "/v1/batches").status_code == 401
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(guarded.url + "/v1/batches", headers=headers).status_code == 200
        second = ServerThread(server.engine, batch_state_dir=str(tmp_path / "own"))
        try:
            response = httpx.get(second.url + "/v1/files")
            assert response.status_code == 503
            assert "in use by another server" in response.json()["message"]
        finally:
            second.stop(shutdown_engine=False)
    finally:
        guarded.stop(shutdown_engine=False)


def test_run_batch_reads_and_writes_urls(tmp_path):
    """-i and -o may be http(s) URLs: the input is read with GET, the output sent with PUT;
    a local output is replaced whole (no temporary file left beside it)."""
    import http.server
    import threading

    from vllm.entrypoints.openai.run_batch import read_input, write_output

    stored: dict[str, bytes] = {"/in.jsonl": b'{"custom_id": "a"}\n'}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            data = stored[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:  # noqa: N802
            stored[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert read_input(base + "/in.jsonl") == '{"custom_id": "a"}\n'
        write_output(base + "/out.jsonl", ['{"x": 1}', '{"x": 2}'], str(tmp_path))
        assert stored["/out.jsonl"] == b'{"x": 1}\n{"x": 2}\n'
    finally:
        httpd.shutdown()
    local = tmp_path / "out.jsonl"
    local.write_text("old")
    write_output(str(local), ['{"y": 1}'])
    assert local.read_text() == '{"y": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_torn_journal_record_is_repaired_on_resume(tmp_path):
    """A journal whose last record a crash tore (or filled with zeros, as a power loss can)
    is cut back to its whole records when the store opens again, so the records appended on
    resume are whole lines and every one of them reads back."""
    store = BatchStore(str(tmp_path))
    store.append_result("b", 0, {"x": 0})
    store.append_result("b", 2, {"x": 2})
    with open(store.results_path("b"), "ab") as f:
        f.write(b'{"line": 1, "out')
    store.append_result("c", 0, {"y": 0})
    with open(store.results_path("c"), "ab") as f:
        f.write(b"\0" * 64)
    leftover = os.path.join(store.files_dir, ".tmp-half-written")
    open(leftover, "wb").close()  # an atomic write the crash cut short

    resumed = BatchStore(str(tmp_path))  # a restarted server
    assert not os.path.exists(leftover)
    resumed.append_result("b", 1, {"x": 1})
    resumed.append_result("b", 3, {"x": 3})
    resumed.append_result("c", 1, {"y": 1})
    assert resumed.load_results("b") == {i: {"x": i} for i in range(4)}
    assert resumed.load_results("c") == {0: {"y": 0}, 1: {"y": 1}}
    for batch_id in ("b", "c"):
        with open(resumed.results_path(batch_id), "rb") as f:
            rows = f.read().split(b"\n")
        assert rows[-1] == b"" and all(json.loads(row) for row in rows[:-1])


def test_store_quota_expiry_sweep_and_owners(tmp_path):
    """Quotas count one owner's live uploads; an expired file is gone at once and the sweep
    removes its bytes; owners survive a restart and never appear in the API objects."""
    from vllm.entrypoints.openai.batch_store import FileQuota, QuotaExceededError

    store = BatchStore(str(tmp_path))
    quota = FileQuota(max_files=2, max_bytes=10)
    now = int(time.time())
    store.add_file(b"abcd", "a", "batch", owner="k1", quota=quota)
    old = store.add_file(b"abcd", "b", "batch", owner="k1", expires_at=now + 3600, quota=quota)
    with pytest.raises(QuotaExceededError, match="--max-files-per-key"):
        store.add_file(b"a", "c", "batch", owner="k1", quota=quota)
    store.add_file(b"abcdefgh", "d", "batch", owner="k2", quota=quota)  # k2 has its own
    with pytest.raises(QuotaExceededError, match="--max-file-bytes-per-key"):
        store.add_file(b"abc", "e", "batch", owner="k2", quota=quota)
    # Past its expiry the file is invisible at once and no longer counts...
    later = now + 3601
    assert store.live_file(old["id"], now=now) is not None
    assert store.live_file(old["id"], now=later) is None
    assert store.sweep(now=later) == [old["id"]]  # ...and the sweep deletes it from disk
    assert not os.path.exists(store.data_path(old["id"]))
    assert old["id"] not in store.files and old["id"] not in BatchStore(str(tmp_path)).files
    store.add_file(b"x", "f", "batch", owner="k1", quota=quota)

    reopened = BatchStore(str(tmp_path))
    assert sorted(reopened.owners.values()) == ["k1", "k1", "k2"]
    assert all("_owner" not in f and "owner" not in f for f in reopened.files.values())


def test_several_api_keys_parsed(tmp_path, monkeypatch):
    """--api-key takes several keys (vLLM's `--api-key K1 K2`, or the flag repeated), plus one
    per line of --api-key-file; VLLM_API_KEY only when neither is given."""
    from vllm.entrypoints.openai.api_server import api_keys_from_args, make_arg_parser

    parser = make_arg_parser()
    monkeypatch.setenv("VLLM_API_KEY", "env")
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nk3\n\n  k4  \n")
    args = parser.parse_args(
        [
            "--model",
            "m",
            "--api-key",
            "k1",
            "k2",
            "--api-key",
            "k1",
            "--api-key-file",
            str(key_file),
        ]
    )
    assert api_keys_from_args(args) == ["k1", "k2", "k3", "k4"]
    assert api_keys_from_args(parser.parse_args(["--model", "m"])) == ["env"]
    with pytest.raises(ValueError, match="--api-key"):
        api_keys_from_args(parser.parse_args(["--model", "m", "--api-key", " "]))


KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def keyed(server, tmp_path_factory):
    """A second app on the shared engine with two API keys and a small file quota."""
    from vllm.entrypoints.openai.batch_store import FileQuota

    srv = ServerThread(
        server.engine,
        api_key=list(KEYS),
        batch_state_dir=str(tmp_path_factory.mktemp("keyed_state")),
        file_quota=FileQuota(max_files=3, max_bytes=100_000),
    )
    yield srv
    srv.stop(shutdown_engine=False)


def test_files_and_batches_scoped_to_their_key(keyed):
    """Either key is accepted; each key sees only its own files and batches (another key's
    id is a 404 on every route, as OpenAI answers), a batch's output belongs to its owner."""
    import openai

    from vllm.entrypoints.openai.api_server import api_key_id

    one, two = (keyed.client(api_key=k) for k in KEYS)
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="key-three").files.list()
    data = long_lines(3, 2, "s")
    upload = one.files.create(file=("s.jsonl", data), purpose="batch")
    store = keyed.server.config.app.state.batches.store
    # The owner is the key's non-secret id: 16 hex digits of its SHA-256.
    assert store.owners[upload.id] == api_key_id(KEYS[0])
    assert api_key_id(KEYS[0]) == hashlib.sha256(KEYS[0].encode()).hexdigest()[:16]
    assert [f.id for f in one.files.list()] == [upload.id]
    assert two.files.list().data == []
    for call in (
        lambda: two.files.retrieve(upload.id),
        lambda: two.files.content(upload.id),
        lambda: two.files.delete(upload.id),
        lambda: two.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    batch = one.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    assert two.batches.list().data == [] and [b.id for b in one.batches.list()] == [batch.id]
    for call in (lambda: two.batches.retrieve(batch.id), lambda: two.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    done = wait_batch(one, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 3
    assert len(read_jsonl(one.files.content(done.output_file_id).text)) == 3
    with pytest.raises(openai.NotFoundError):
        two.files.content(done.output_file_id)
    assert one.files.delete(upload.id).deleted


def test_file_quota_and_expires_after(keyed):
    """Uploads past the quota get a 429 naming the flag; expires_after (OpenAI's range) sets
    expires_at, output_expires_after the output's; an expired file is a 404 and swept."""
    import openai

    one = keyed.client(api_key=KEYS[1])
    row = line("q-0", "/v1/completions", completion_body(0, 2)) + "\n"
    first = one.files.create(
        file=("q.jsonl", row.encode()),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert first.expires_at == first.created_at + 3600
    bad_values = [
        {"anchor": "created_at", "seconds": 60},
        {"anchor": "last_active_at", "seconds": 3600},
        {"anchor": "created_at", "seconds": 2592001},
    ]
    for bad in bad_values:
        with pytest.raises(openai.BadRequestError, match="expires_after") as err:
            one.files.create(file=("q.jsonl", row.encode()), purpose="batch", expires_after=bad)
        assert err.value.body["param"] == "expires_after"
    headers = {"Authorization": f"Bearer {KEYS[1]}"}
    extra = httpx.post(
        keyed.url + "/v1/files",
        headers=headers,
        files={"file": ("q.jsonl", row.encode())},
        data={"purpose": "batch", "expiry": "soon"},
    )
    assert extra.status_code == 400 and extra.json()["param"] == "expiry"
    big = one.files.create(file=("q.jsonl", row.encode() * 400), purpose="batch")
    with pytest.raises(openai.RateLimitError, match="--max-file-bytes-per-key"):
        one.files.create(file=("q.jsonl", row.encode() * 300), purpose="batch")
    one.files.create(file=("q.jsonl", row.encode()), purpose="batch")
    with pytest.raises(openai.RateLimitError, match="--max-files-per-key"):
        one.files.create(file=("q.jsonl", row.encode()), purpose="batch")
    one.files.delete(big.id)  # room again

    batch = one.batches.create(
        input_file_id=first.id,
        endpoint="/v1/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    output = one.files.retrieve(wait_batch(one, batch.id).output_file_id)
    assert output.expires_at == output.created_at + 7200
    # Expire the upload (its clock moved past expires_at): a 404 at once, gone after a sweep.
    store = keyed.server.config.app.state.batches.store
    store.files[first.id]["expires_at"] = int(time.time()) - 1
    with pytest.raises(openai.NotFoundError):
        one.files.content(first.id)
    assert first.id not in [f.id for f in one.files.list()]
    assert store.sweep() == [first.id] and not os.path.exists(store.data_path(first.id))


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the server and whatever processes it started (no shutdown code runs)."""
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait()
    for child in children:
        if child.is_running():
            child.kill()


@pytest.mark.slow  # four server processes
def test_sigkill_during_batch_and_restart_exactly_once(tiny_model_dirs, tmp_path, server):
    """A server SIGKILLed at random points of a batch (three times, fixed seed) and restarted
    on the same state directory each time finishes it: every input line in the output exactly
    once, the journal whole lines only, and each line's text that of the same batch run on a
    server that never crashed (greedy)."""
    import random

    from vllm.entrypoints.openai.batch_store import read_journal

    rng = random.Random(42)
    state = str(tmp_path / "state")
    n = 32
    # Lengths that differ, so lines finish (and are recorded) at different moments; long
    # enough that the batch is still running when the last kill lands.
    rows = [
        line(f"k-{i}", "/v1/completions", completion_body(i, 24 + 8 * (i % 5), ignore_eos=True))
        for i in range(n)
    ]
    data = ("\n".join(rows) + "\n").encode()
    proc, url = _start_server(tiny_model_dirs[KIND], state)
    try:
        client = _client(url)
        upload = client.files.create(file=("k.jsonl", data), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        for kill in range(3):
            # A random number of lines more, then a random moment: the kill can land while a
            # line is recorded, between lines, or while the counts are saved.
            # The restarted server resumes the batch before this loop reads its count, so the
            # target is capped below the end: a target past the last line is never reached.
            done = client.batches.retrieve(batch.id).request_counts.completed
            target = min(done + rng.randint(2, 6), n - (3 - kill))
            deadline = time.time() + 240
            while (done := client.batches.retrieve(batch.id).request_counts.completed) < target:
                assert time.time() < deadline, f"{done} of {n} lines before kill {kill}"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.5))
            _kill(proc)
            journal = state + f"/batches/{batch.id}.results"
            recorded, _, _ = read_journal(journal)
            print(f"kill {kill}: {len(recorded)} of {n} lines recorded")
            proc, url = _start_server(tiny_model_dirs[KIND], state)
            client = _client(url)
        resumed = wait_batch(client, batch.id)
        assert resumed.status == "completed", resumed
        assert resumed.request_counts.completed == n and resumed.request_counts.failed == 0
        outputs = read_jsonl(client.files.content(resumed.output_file_id).text)
        assert _stop(proc) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            _kill(proc)
    assert [o["custom_id"] for o in outputs] == [f"k-{i}" for i in range(n)]
    with open(journal, "rb") as f:
        rows = f.read().split(b"\n")
    assert rows[-1] == b"", "the journal ends inside a record"
    assert sorted(json.loads(row)["line"] for row in rows[:-1]) == list(range(n))  # once each

    # The same batch on the shared server, which never crashed.
    reference = server.client()
    upload = reference.files.create(file=("k.jsonl", data), purpose="batch")
    batch = reference.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    done = wait_batch(reference, batch.id)
    wanted = read_jsonl(reference.files.content(done.output_file_id).text)
    assert [choice_text(o) for o in outputs] == [choice_text(o) for o in wanted]
