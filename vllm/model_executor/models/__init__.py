"""Model classes by HF architecture name (the table is `vllm.model_registry`)."""

from __future__ import annotations

import importlib
from typing import Any

from vllm.model_registry import MODELS, check_architecture


def get_model_class(hf_config: Any) -> type:
    module_name, class_name = MODELS[check_architecture(hf_config)]
    module = importlib.import_module(f"vllm.model_executor.models.{module_name}")
    return getattr(module, class_name)
