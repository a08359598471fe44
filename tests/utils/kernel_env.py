"""Switching the C++ kernels on or off inside a test: VLLM_PP_DISABLE_KERNELS is read once by
vllm._custom_ops (cached), so setting it must also make the ops read it again."""

from __future__ import annotations

import pytest


def set_kernels(monkeypatch: pytest.MonkeyPatch, enabled: bool) -> None:
    """Kernels on (the variable unset) or off (=1) from here on; monkeypatch restores the
    variable after the test, and the conftest's autouse fixture forgets the cached value."""
    from vllm import _custom_ops as ops

    if enabled:
        monkeypatch.delenv(ops.DISABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(ops.DISABLE_ENV, "1")
    ops.reset_availability()
