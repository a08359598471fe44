"""Installs the `vllm` package (vllm-pp). torch must already be installed (the CPU build:
`pip install torch==2.13.0` first, then `pip install --no-build-isolation .`, or `make install`).

Dependencies: `install_requires` is what `vllm`, `LLM` and `vllm serve` import; the extras
`[test]` (the test suite's oracles and clients) and `[dev]` (the linters too) add the rest.
They are ranges; requirements/*.txt pin the versions `make install` and CI use.

The C++ CPU kernels in csrc/ are built as the extension `vllm._C` with torch's cpp_extension.
They are optional: without torch at build time, or if the compiler fails, the package installs
without them (with a warning) and the engine uses its pure-torch code. Set
VLLM_PP_SKIP_KERNELS=1 to skip the build on purpose, VLLM_PP_REQUIRE_KERNELS=1 to make a
failed build an error (CI sets it: a green run then means the kernels were built).
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

# What the runtime imports (vllm/, `vllm serve`, Ray Data batch inference). torch is a range
# the pinned CPU build (2.13.0+cpu) satisfies: pip keeps an installed torch that fits, and
# never replaces it with a CUDA wheel. The lower bounds are the versions CI tests
# (requirements/runtime.txt pins them); the upper ones stop at the next major release.
INSTALL_REQUIRES = [
    "torch>=2.13.0,<2.14",
    "transformers>=5.23.0,<6",
    "tokenizers>=0.23.3,<0.24",
    "safetensors>=0.8.0,<1",
    "gguf>=0.19.0,<1",
    "ray[data]>=2.60.0,<3",
    "tqdm>=4.66",
    "numpy>=1.26",
    "psutil>=5.9",
    "cloudpickle>=3.1.2,<4",
    "typing_extensions>=4.10",
    "pandas>=2.2",
    "fastapi>=0.163.2,<1",
    "pydantic>=2.9,<3",
    "pydantic-core>=2",
    "uvicorn>=0.54.0,<1",
    "prometheus-client>=0.26.0,<1",
    "httpx>=0.28.1,<1",
    # The rank handshake (X25519 and HKDF, vllm/distributed/rank_handshake.py); the tests'
    # TLS certificates use it too.
    "cryptography>=42",
    "xgrammar>=0.2.8,<0.3",
]

# The test suite: its oracles (HF GGUF loading needs accelerate, PEFT adapters, schema and
# Lark validators), the OpenAI client it drives the server with, a TLS certificate maker.
TEST_REQUIRES = [
    "pytest>=8",
    "accelerate>=1.15.0,<2",
    "openai>=3.51.0,<4",
    "jsonschema>=4.26.0,<5",
    "peft>=0.21.2,<1",
    "lark>=1.3.1,<2",
    # tests/models/test_requirements.py checks the pins above against these ranges.
    "packaging>=23",
]

# `make test`'s linters and type checker on top of the tests.
DEV_REQUIRES = [*TEST_REQUIRES, "ruff==0.17.6", "mypy==2.4.1"]

EXTRAS_REQUIRE = {"test": TEST_REQUIRES, "dev": DEV_REQUIRES}


def _switch(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _warn(message: str) -> None:
    # stderr: pip shows it with -v, and it does not look like a build failure.
    print(f"WARNING (vllm-pp): {message}", file=sys.stderr)


def _kernel_build() -> dict[str, Any]:
    """setup() keywords that build csrc/ into vllm._C, or {} when that cannot happen."""
    require = _switch("VLLM_PP_REQUIRE_KERNELS")
    if _switch("VLLM_PP_SKIP_KERNELS"):
        if require:
            raise SystemExit(
                "vllm-pp: VLLM_PP_SKIP_KERNELS=1 and VLLM_PP_REQUIRE_KERNELS=1 contradict "
                "each other; unset one."
            )
        _warn("VLLM_PP_SKIP_KERNELS=1: not building the C++ kernels.")
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension, is_ninja_available
    except ImportError as exc:
        if require:
            raise SystemExit(
                f"vllm-pp: VLLM_PP_REQUIRE_KERNELS=1 but torch is not importable ({exc}): "
                "install torch first and use --no-build-isolation."
            ) from exc
        _warn(
            f"torch is not importable ({exc}); building without the C++ kernels. Install torch "
            "first and use --no-build-isolation."
        )
        return {}

    class OptionalBuildExtension(BuildExtension):
        """Builds the extension if it can; otherwise warns and installs without it (or, with
        VLLM_PP_REQUIRE_KERNELS=1, fails the install)."""

        def build_extensions(self) -> None:
            try:
                super().build_extensions()
            except Exception as exc:  # compiler missing or failing: fall back to pure torch
                if require:
                    raise SystemExit(
                        f"vllm-pp: building the C++ kernels failed ({exc}) and "
                        "VLLM_PP_REQUIRE_KERNELS=1 makes that an error."
                    ) from exc
                _warn(
                    f"building the C++ kernels failed ({exc}); installing without them, "
                    "the engine will use its pure-torch code (see vllm/_custom_ops.py)."
                )
                # Nothing was built: later steps (copying outputs in editable mode) skip it.
                self.extensions = []

        def get_outputs(self) -> list[str]:
            return super().get_outputs() if self.extensions else []

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp"), root_dir=ROOT))
    extension = CppExtension(
        name="vllm._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        # No -march=native (the wheel could run on another CPU) and no -ffast-math (results
        # must match torch within fp32 tolerance): csrc/ picks AVX-512/AVX2 at run time.
        # -g0: no debug info (4.8 MB -> 0.2 MB, faster build). -Wno-psabi: the wide vector
        # types only pass between always-inlined functions, so their ABI does not matter.
        # -fopenmp: at::parallel_for is a header template that is only parallel when the code
        # including it is built with OpenMP. The library then needs libgomp.so.1, which the
        # torch already loaded provides, so there is a single OpenMP runtime.
        extra_compile_args=["-O3", "-g0", "-Wall", "-Wno-psabi", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    )
    # ninja, when installed, compiles the sources in parallel; setuptools compiles them one by
    # one otherwise (about 20 s either way on 2 cores), without torch's warning about it.
    build_ext = OptionalBuildExtension.with_options(use_ninja=is_ninja_available())
    return {"ext_modules": [extension], "cmdclass": {"build_ext": build_ext}}


setup(
    name="vllm-pp",
    version="0.1.0",
    description="A vLLM-compatible inference engine built around pipeline parallelism",
    packages=find_packages(include=["vllm", "vllm.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["vllm = vllm.scripts:main"]},
    **_kernel_build(),
)
