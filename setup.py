"""Installs the `vllm` package (vllm-pp). Use `make install`: torch must already be installed."""

from setuptools import find_packages, setup

setup(
    name="vllm-pp",
    version="0.1.0",
    description="A vLLM-compatible inference engine built around pipeline parallelism",
    packages=find_packages(include=["vllm", "vllm.*"]),
    python_requires=">=3.10",
)
