"""The model registry: which HF architectures the engine runs, and the module of each.

Torch-free and below the config: `ModelConfig` validates a checkpoint's architecture here
without importing any model code; `vllm.model_executor.models` loads the class.
"""

from __future__ import annotations

from typing import Any

# Imported lazily so that reading the registry (config validation) does not import torch.
MODELS: dict[str, tuple[str, str]] = {
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    # Encoder-only (BERT family): pooling models, whole prompts, no KV cache.
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaModel": ("roberta", "RobertaModel"),
    "RobertaForSequenceClassification": ("roberta", "RobertaForSequenceClassification"),
    "XLMRobertaModel": ("roberta", "XLMRobertaModel"),
    "XLMRobertaForSequenceClassification": ("roberta", "XLMRobertaForSequenceClassification"),
}

# Architectures whose stages attend bidirectionally over each whole prompt and keep no KV.
ENCODER_ONLY_ARCHS = frozenset(
    {
        "BertModel",
        "BertForSequenceClassification",
        "RobertaModel",
        "RobertaForSequenceClassification",
        "XLMRobertaModel",
        "XLMRobertaForSequenceClassification",
    }
)


def get_supported_archs() -> list[str]:
    return list(MODELS)


def is_encoder_only(hf_config: Any) -> bool:
    """Whether the config's (supported) architecture is an encoder-only one."""
    return check_architecture(hf_config) in ENCODER_ONLY_ARCHS


def check_architecture(hf_config: Any) -> str:
    """The first supported architecture named in the config; ValueError naming it if none."""
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            return arch
    raise ValueError(
        f"Model architectures {archs} are not supported for now. "
        f"Supported architectures: {get_supported_archs()}"
    )
