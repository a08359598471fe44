"""The engine's bookkeeping imports no torch: configs, scheduler, block manager, sequences,
sampling params, outputs, environment registry, GGUF header/config side and the torch-free
engine modules load in a fresh interpreter without `torch` (nor `transformers`) appearing in
`sys.modules`. Also: `outputs.py` does not import the engine (no import circle)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fast

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TORCH_FREE_MODULES = [
    "vllm",
    "vllm.config",
    "vllm.envs",
    "vllm.logger",
    "vllm.inputs",
    "vllm.sequence",
    "vllm.sampling_params",
    "vllm.outputs",
    "vllm.core.block_manager",
    "vllm.core.scheduler",
    "vllm.core.budget",
    "vllm.core.classic_policy",
    "vllm.core.chunked_policy",
    "vllm.core.lora_admission",
    "vllm.core.step_writer",
    "vllm.step_records",
    "vllm.worker.request_table",
    "vllm.lora.request",
    "vllm.lora.peft_config",
    "vllm.lora.registry",
    "vllm.entrypoints.openai.lora_modules",
    "vllm.utils",
    "vllm.engine.beam_search",
    "vllm.engine.detokenizer",
    "vllm.engine.interrupts",
    "vllm.engine.metrics",
    "vllm.engine.output_processor",
    "vllm.engine.request_validation",
    "vllm.engine.stop_checker",
    "vllm.transformers_utils.gguf_config",
    "vllm.distributed.pipeline_resize",
    "vllm.resilience.errors",
    "vllm.resilience.events",
    "vllm.resilience.replay",
    "vllm.resilience.coordinator",
    "vllm.resilience.plans.shrink",
]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )


def test_core_modules_import_no_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr


def test_outputs_does_not_import_the_engine() -> None:
    result = _run(
        "import sys, vllm.outputs\n"
        "engine = sorted(m for m in sys.modules if m.startswith('vllm.engine'))\n"
        "assert not engine, engine\n"
    )
    assert result.returncode == 0, result.stderr


def test_public_api_still_resolves() -> None:
    result = _run("from vllm import LLM, SamplingParams, EngineArgs; print(LLM.__name__)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "LLM"
