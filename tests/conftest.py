"""Shared pytest fixtures: one local Ray instance per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A single-process engine (and a server's, in its subprocess) runs its tiny models on one
# torch thread, as every mp and Ray stage does by default. With torch's default of two, its
# steps stall on OpenMP barriers whenever the 2-core machine is busy (the suite's own stage
# processes, Ray): 8 prompts x 32 tokens took 6.3-8.2 s on two threads against 0.5-1.7 s on
# one (measured with the suite running alongside). Tests that need two threads set them
# (the kernels' thread-split tests); `VLLM_CPU_THREADS_PER_STAGE=` runs torch's default.
os.environ.setdefault("VLLM_CPU_THREADS_PER_STAGE", "1")
# Warm spare rank processes (VLLM_PP_SPARE_PROCESSES, 1 by default) exist to replace a failed
# stage; every PP > 1 engine otherwise starts one, torch imported, that only the tests which
# kill stages use: on this 2-core machine it took ~10% off the wall time of three PP test
# modules (106 -> 96 s). Off here, except in modules that set WARM_SPARES = True (those run
# with the production default: see _warm_spares below).
os.environ.setdefault("VLLM_PP_SPARE_PROCESSES", "0")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # The ISA list needs the C++ extension, hence torch: asked for only by tests that use
    # `isa`, so the torch-free unit tests (make test-fast) never import torch.
    if "isa" in metafunc.fixturenames:
        from vllm import _custom_ops as ops

        metafunc.parametrize("isa", ops.supported_isas(), indirect=True)


@pytest.fixture
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test with each instruction-set variant of the C++ kernels this CPU can execute
    (generic, AVX2, AVX-512), restoring the best one afterwards."""
    from vllm import _custom_ops as ops

    best = ops.cpu_isa()
    ops.set_cpu_isa(request.param)
    yield request.param
    ops.set_cpu_isa(best)


@pytest.fixture(scope="module", autouse=True)
def _warm_spares(request: pytest.FixtureRequest) -> Iterator[None]:
    """One warm spare per engine, as in production, for the engines a module that sets
    WARM_SPARES = True builds (its fault tests replace stages from them)."""
    if not getattr(request.module, "WARM_SPARES", False):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_PP_SPARE_PROCESSES", "1")
        yield


@pytest.fixture(scope="session")
def ray_session():
    """Start one local Ray instance for the whole session (4 logical CPUs so PP=4 places)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """kind -> saved HF directory of each tiny random model (built once per session)."""
    from tests.utils import tiny_models

    return tiny_models.model_dirs(str(tmp_path_factory.mktemp("tiny_models")))


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dirs):
    """kind -> HF greedy token ids for tiny_models.PROMPTS (32 new tokens), computed once."""
    from tests.utils import tiny_models

    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = tiny_models.hf_greedy(tiny_model_dirs[kind], tiny_models.PROMPTS, 32)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def pooling_model_dirs(tmp_path_factory):
    """name -> saved directory of each tiny pooling model (tests/utils/pooling_models.py):
    the four families' embedders, sentence-transformers MEAN and Matryoshka variants of the
    LLaMA one, a 3-label LLaMA classifier and a 1-label Qwen3 cross-encoder."""
    from tests.utils import pooling_models

    return pooling_models.model_dirs(str(tmp_path_factory.mktemp("pooling_models")))


@pytest.fixture(autouse=True)
def _kernels_availability_read_again() -> Iterator[None]:
    """vllm._custom_ops reads VLLM_PP_DISABLE_KERNELS once: each test starts and ends with it
    forgotten, so a value a test set (monkeypatch restores the variable) does not stay. Only
    when the ops are imported: the torch-free unit tests never import them."""
    import sys

    ops = sys.modules.get("vllm._custom_ops")
    if ops is not None:
        ops.reset_availability()
    yield
    ops = sys.modules.get("vllm._custom_ops")
    if ops is not None:
        ops.reset_availability()


@pytest.fixture(autouse=True)
def _vllm_logs_reach_caplog():
    """The "vllm" logger prints itself and does not propagate (as in vLLM); let pytest's
    caplog see its records too, whichever test configured it first."""
    import logging

    logger = logging.getLogger("vllm")
    old = logger.propagate
    logger.propagate = True
    yield
    logger.propagate = old
