"""vllm-pp: a vLLM-compatible inference engine built around pipeline parallelism.

The public names are loaded lazily, so importing a torch-free submodule (the scheduler, the
block manager, sequences) does not pull in torch through this package.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "vllm.entrypoints.llm",
    "SamplingParams": "vllm.sampling_params",
    "RequestOutput": "vllm.outputs",
    "CompletionOutput": "vllm.outputs",
    "EngineArgs": "vllm.engine.arg_utils",
    "LLMEngine": "vllm.engine.llm_engine",
    "AsyncLLMEngine": "vllm.engine.async_llm_engine",
    "AsyncEngineArgs": "vllm.engine.arg_utils",
    "TextPrompt": "vllm.inputs",
    "TokensPrompt": "vllm.inputs",
    "PromptInputs": "vllm.inputs",
    "PoolingParams": "vllm.pooling_params",
    "PoolingOutput": "vllm.outputs",
    "PoolingRequestOutput": "vllm.outputs",
    "EmbeddingOutput": "vllm.outputs",
    "EmbeddingRequestOutput": "vllm.outputs",
    "ClassificationOutput": "vllm.outputs",
    "ClassificationRequestOutput": "vllm.outputs",
    "ScoringOutput": "vllm.outputs",
    "ScoringRequestOutput": "vllm.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'vllm' has no attribute {name!r}")
