"""Model classes by HF architecture name (the table is `vllm.model_registry`)."""

from __future__ import annotations

import importlib
from typing import Any

from vllm.model_registry import MODELS, check_architecture


def get_model_class(hf_config: Any, model_config: Any = None) -> type:
    """The stage module class; for a decoder run by the pooling runner (`model_config`'s
    `runner_type == "pooling"`), its pooling form (`adapters.as_pooling_model`)."""
    module_name, class_name = MODELS[check_architecture(hf_config)]
    module = importlib.import_module(f"vllm.model_executor.models.{module_name}")
    cls: type = getattr(module, class_name)
    pooling = model_config is not None and getattr(model_config, "runner_type", "") == "pooling"
    if pooling and not getattr(model_config, "is_encoder_only", False):
        from vllm.model_executor.models.adapters import as_pooling_model

        return as_pooling_model(cls, model_config.convert_type)
    return cls
