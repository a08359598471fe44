"""Fixtures shared by the model tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="package")
def hf_smollm2() -> Any:
    """transformers' float32 model of the bundled SmolLM2 GGUF (dequantized at load), in eval
    mode: the oracle of test_gguf.py, test_gguf_quant.py and test_smollm2.py. Loading it takes
    ~30 s (transformers dequantizes all 272 tensors), so it is loaded once for this package;
    the tests only read it (greedy generate, forward passes, state_dict comparisons)."""
    from tests.utils import tiny_models

    return tiny_models.load_hf_smollm2()
