"""Smoke tests of the user-facing scripts (run.py, masstest.py, benchmarks/throughput.py), each
run as a subprocess on a tiny LLaMA exactly as a user would run it.

The scripts run one after another: started together they were slower on a 2-core machine
(three Ray instances fighting for the cores). Ray start-up dominates each PP=2 run.
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

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
MASSTEST_ARGS = [
    "--pipeline_parallel_size",
    "2",
    "--verify",
    "--num_prompts",
    "40",
    "--max_tokens",
    "8",
    "--abort_frac",
    "0.1",
    "--squeeze_kv",
    "--random_sampling_frac",
    "0.2",
    "--timeout",
    str(TIMEOUT_S),
]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dirs: dict[str, str]) -> str:
    return tiny_model_dirs["llama-gqa-untied"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # the tests read the engine's "# GPU blocks" line
    # Multi-threaded GEMMs of a PP=1 engine (or HF) stall badly when the machine is busy.
    env.setdefault("VLLM_CPU_THREADS_PER_STAGE", "1")
    return env


def _entry(script: str) -> list[str]:
    """A root script by its file (run.py), a benchmark by its module (benchmarks.throughput)."""
    return [script] if script.endswith(".py") else ["-m", script]


def _run(script: str, args: list[str], tmp_path: Path) -> tuple[int, str, Any]:
    """Run one script; returns (exit code, stdout + stderr, its --output-json or None)."""
    json_path = tmp_path / "out.json"
    try:
        proc = subprocess.run(
            [sys.executable, *_entry(script), *args, "--output-json", str(json_path)],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} did not finish in {TIMEOUT_S} s:\n{str(exc.output)[-4000:]}")
    data = json.loads(json_path.read_text()) if json_path.exists() else None
    return proc.returncode, proc.stdout, data


def test_run_py_pp2(tiny_llama: str, tmp_path: Path) -> None:
    args = [
        "--model",
        tiny_llama,
        "--max_tokens",
        "4",
        "-bsl",
        "1,2",
        "--pipeline_parallel_size",
        "2",
        "--kv_cache_space",
        "0.05",
        "--speculative_config",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}',
    ]
    code, out, data = _run("run.py", args, tmp_path)
    assert code == 0, out[-4000:]
    assert "# GPU blocks" in out
    assert [r["batch_size"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert r["output_tokens"] == 4 * r["batch_size"]  # ignore_eos: exactly max_tokens each
        assert r["output_tokens_per_s"] > 0 and r["latency_s"] > 0
        assert len(r["peak_rss_bytes_per_stage"]) == 2
        assert 0.0 <= r["draft_acceptance"] <= 1.0  # the speculative column
    assert [s["layers"] for s in data["layout"]["stages"]] == [[0, 3], [3, 6]]
    # The timing table has one row per batch size: batch, latency, output tok/s, total tok/s.
    assert re.search(r"^\s+1\s+[\d.]+\s+[\d.]+\s+[\d.]+\s", out, re.M), out[-2000:]
    assert re.search(r"^\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+\s", out, re.M), out[-2000:]


def test_masstest_pp2_verify_passes(tiny_llama: str, tmp_path: Path) -> None:
    code, out, data = _run("masstest.py", ["--model", tiny_llama, *MASSTEST_ARGS], tmp_path)
    assert code == 0, out[-4000:]
    assert "masstest: PASS" in out and "RUN ALL" in out
    summary = data["summary"]
    assert summary["requests"] == 40 and 1 <= summary["aborted"] <= 4
    assert summary["finished"] + summary["aborted"] == 40
    assert summary["preemptions"] > 0  # --squeeze_kv must actually squeeze
    assert summary["verified"] > 0 and data["errors"] == []


def test_masstest_corruption_is_caught(tiny_llama: str, tmp_path: Path) -> None:
    args = ["--model", tiny_llama, *MASSTEST_ARGS, "--corrupt-for-test"]
    code, out, data = _run("masstest.py", args, tmp_path)
    assert code != 0, out[-4000:]
    assert "differs from PP=1" in out and "masstest: FAIL" in out
    assert len(data["errors"]) == 1  # exactly the flipped token, nothing else


def test_throughput_compare_hf(tiny_llama: str, tmp_path: Path) -> None:
    args = ["--model", tiny_llama, "--num-prompts", "4", "--output-len", "4", "--compare-hf"]
    code, out, data = _run("benchmarks.throughput", args, tmp_path)
    assert code == 0, out[-4000:]
    assert len(re.findall(r"^Throughput: [\d.]+ requests/s, [\d.]+ tokens/s$", out, re.M)) == 2
    assert re.search(r"^Ratio ours/HF \(generated tokens/s\): [\d.]+x", out, re.M)
    assert [r["output_tokens"] for r in data["results"]] == [16, 16]
    assert data["ratio_ours_over_hf"] > 0
