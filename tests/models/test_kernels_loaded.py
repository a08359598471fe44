"""The C++ CPU kernels (`vllm._C`) are loaded, and the instruction set they run is the best
this CPU supports. Never skipped because `vllm._C` is missing: that is a failure (every kernel
test module skips then, so without this CI could pass on the pure-torch fallback). Skipped
only when the kernels are turned off on purpose (VLLM_PP_DISABLE_KERNELS=1 or
VLLM_PP_SKIP_KERNELS=1). Also: the fallback, when the extension is missing, is a WARNING that
says what it costs.

Both checks run in a fresh interpreter: this process may have lowered the ISA for a test
(`set_cpu_isa`) or imported the ops before a variable changed.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from vllm import envs

REPO = pathlib.Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "INFO"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def _best_isa_of_this_cpu() -> str | None:
    """What csrc/cpu_isa.cpp picks, from the kernel's CPU flags (None: not Linux x86)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    lines = [line for line in text.splitlines() if line.startswith("flags")]
    if not lines:
        return None
    flags = set(lines[0].split(":", 1)[1].split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "generic"


def test_cpp_kernels_are_loaded_and_name_their_isa(record_property):
    for switch in ("VLLM_PP_DISABLE_KERNELS", "VLLM_PP_SKIP_KERNELS"):
        if envs.get_bool(switch):
            pytest.skip(f"{switch}=1: the C++ kernels are off on purpose")
    result = _python(
        "import torch, vllm._C\n"
        "from vllm import _custom_ops as ops\n"
        "assert ops.is_available()\n"
        "print(ops.cpu_isa())\n"
    )
    assert result.returncode == 0, (
        "vllm._C does not load, so the engine runs its pure-torch fallback: rebuild with "
        "`VLLM_PP_REQUIRE_KERNELS=1 pip install --no-build-isolation -e .` (or `python "
        "setup.py build_ext --inplace`) to see why.\n" + result.stderr[-2000:]
    )
    isa = result.stdout.strip().splitlines()[-1]
    record_property("cpu_isa", isa)
    print(f"vllm._C loaded; the kernels run {isa}")
    expected = _best_isa_of_this_cpu()
    assert isa == (expected or isa), f"the kernels run {isa}; this CPU supports {expected}"


def test_missing_kernels_are_a_warning_that_names_the_cost():
    # `None` in sys.modules makes `import vllm._C` raise ModuleNotFoundError, as when the
    # extension was never built.
    result = _python(
        "import sys\n"
        "sys.modules['vllm._C'] = None\n"
        "from vllm import _custom_ops as ops\n"
        "assert not ops.is_available()\n"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if "C++ CPU kernels" in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING"), result.stdout[-2000:]
    assert "not built" in lines[0] and "dequantized to dense" in lines[0]
    assert "4x the memory" in lines[0] and "pure torch" in lines[0]
