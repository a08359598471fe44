"""Installs the `vllm` package (vllm-pp). Use `make install`: torch must already be installed.

The C++ CPU kernels in csrc/ are built as the extension `vllm._C` with torch's cpp_extension.
They are optional: without torch at build time, or if the compiler fails, the package installs
without them (with a warning) and the engine uses its pure-torch attention. Set
VLLM_PP_SKIP_KERNELS=1 to skip the build on purpose.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _warn(message: str) -> None:
    # stderr: pip shows it with -v, and it does not look like a build failure.
    print(f"WARNING (vllm-pp): {message}", file=sys.stderr)


def _kernel_build() -> dict[str, Any]:
    """setup() keywords that build csrc/ into vllm._C, or {} when that cannot happen."""
    if os.environ.get("VLLM_PP_SKIP_KERNELS", "0") == "1":
        _warn("VLLM_PP_SKIP_KERNELS=1: not building the C++ kernels.")
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension, is_ninja_available
    except ImportError as exc:
        _warn(
            f"torch is not importable ({exc}); building without the C++ kernels. Install torch "
            "first and use --no-build-isolation."
        )
        return {}

    class OptionalBuildExtension(BuildExtension):
        """Builds the extension if it can; otherwise warns and installs without it."""

        def build_extensions(self) -> None:
            try:
                super().build_extensions()
            except Exception as exc:  # compiler missing or failing: fall back to pure torch
                _warn(
                    f"building the C++ kernels failed ({exc}); installing without them, "
                    "the engine will use the pure-torch attention."
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
    entry_points={"console_scripts": ["vllm = vllm.scripts:main"]},
    **_kernel_build(),
)
