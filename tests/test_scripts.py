"""Smoke tests of the user-facing scripts (run.py, masstest.py, benchmarks/throughput.py), each
run as a subprocess on a tiny LLaMA exactly as a user would run it.

Ray start-up dominates each PP=2 run, so the four scripts are started together and run
concurrently; every test then waits for its own process. That keeps this file well under the
time the same runs would take one after another.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # the tests read the engine's "# GPU blocks" line
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


@pytest.fixture(scope="module")
def script_runs(tiny_model_dirs: dict[str, str], tmp_path_factory: Any) -> dict[str, Any]:
    """name -> (Popen, json path): all four scripts started at once."""
    model = tiny_model_dirs["llama-gqa-untied"]
    out = tmp_path_factory.mktemp("script_runs")
    masstest = ["masstest.py", "--model", model, "--pipeline_parallel_size", "2", "--verify",
                "--num_prompts", "40", "--max_tokens", "8", "--abort_frac", "0.1", "--squeeze_kv",
                "--random_sampling_frac", "0.2", "--timeout", str(TIMEOUT_S)]
    commands = {
        "run": ["run.py", "--model", model, "--max_tokens", "4", "-bsl", "1,2",
                "--pipeline_parallel_size", "2", "--kv_cache_space", "0.05"],
        "masstest": masstest,
        "corrupt": [*masstest, "--corrupt-for-test"],
        "throughput": ["benchmarks/throughput.py", "--model", model, "--num-prompts", "4",
                       "--output-len", "4", "--compare-hf"],
    }
    runs = {}
    for name, cmd in commands.items():
        json_path = out / f"{name}.json"
        runs[name] = (
            subprocess.Popen(
                [sys.executable, *cmd, "--output-json", str(json_path)],
                cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True,
            ),
            json_path,
        )
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _finish(runs: dict[str, Any], name: str) -> tuple[int, str, Any]:
    """Wait for one script; returns (exit code, combined output, parsed JSON or None)."""
    proc, json_path = runs[name]
    try:
        stdout, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
        pytest.fail(f"{name} did not finish in {TIMEOUT_S} s:\n{stdout[-4000:]}")
    data = json.loads(json_path.read_text()) if json_path.exists() else None
    return proc.returncode, stdout, data


def test_run_py_pp2(script_runs: dict[str, Any]) -> None:
    code, out, data = _finish(script_runs, "run")
    assert code == 0, out[-4000:]
    assert "# GPU blocks" in out
    assert [r["batch_size"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert r["output_tokens"] == 4 * r["batch_size"]  # ignore_eos: exactly max_tokens each
        assert r["output_tokens_per_s"] > 0 and r["latency_s"] > 0
        assert len(r["peak_rss_bytes_per_stage"]) == 2
    assert [s["layers"] for s in data["layout"]["stages"]] == [[0, 3], [3, 6]]
    # The timing table has one row per batch size: batch, latency, output tok/s, total tok/s.
    assert re.search(r"^\s+1\s+[\d.]+\s+[\d.]+\s+[\d.]+\s", out, re.M), out[-2000:]
    assert re.search(r"^\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+\s", out, re.M), out[-2000:]


def test_masstest_pp2_verify_passes(script_runs: dict[str, Any]) -> None:
    code, out, data = _finish(script_runs, "masstest")
    assert code == 0, out[-4000:]
    assert "masstest: PASS" in out and "RUN ALL" in out
    summary = data["summary"]
    assert summary["requests"] == 40 and summary["aborted"] == 4
    assert summary["finished"] + summary["aborted"] == 40
    assert summary["preemptions"] > 0  # --squeeze_kv must actually squeeze
    assert summary["verified"] > 0 and data["errors"] == []


def test_masstest_corruption_is_caught(script_runs: dict[str, Any]) -> None:
    code, out, data = _finish(script_runs, "corrupt")
    assert code != 0, out[-4000:]
    assert "differs from PP=1" in out and "masstest: FAIL" in out
    assert len(data["errors"]) == 1  # exactly the flipped token, nothing else


def test_throughput_compare_hf(script_runs: dict[str, Any]) -> None:
    code, out, data = _finish(script_runs, "throughput")
    assert code == 0, out[-4000:]
    assert len(re.findall(r"^Throughput: [\d.]+ requests/s, [\d.]+ tokens/s$", out, re.M)) == 2
    assert re.search(r"^Ratio ours/HF \(generated tokens/s\): [\d.]+x", out, re.M)
    assert [r["output_tokens"] for r in data["results"]] == [16, 16]
    assert data["ratio_ours_over_hf"] > 0
