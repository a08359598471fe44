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
    # Pooling models (vLLM's pooling runner): decoder stacks without an lm_head ...
    "LlamaModel": ("llama", "LlamaForCausalLM"),
    "MistralModel": ("mistral", "MistralForCausalLM"),
    "Qwen2Model": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3Model": ("qwen3", "Qwen3ForCausalLM"),
    # ... with a sequence-classification `score` head ...
    "LlamaForSequenceClassification": ("llama", "LlamaForCausalLM"),
    "MistralForSequenceClassification": ("mistral", "MistralForCausalLM"),
    "Qwen2ForSequenceClassification": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForCausalLM"),
    # ... and encoder-only models (bidirectional attention, no KV cache kept).
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaModel": ("roberta", "RobertaModel"),
    "RobertaForSequenceClassification": ("roberta", "RobertaForSequenceClassification"),
    "XLMRobertaModel": ("roberta", "XLMRobertaModel"),
    "XLMRobertaForSequenceClassification": ("roberta", "XLMRobertaForSequenceClassification"),
}

# What a pooling architecture is converted to by default ("embed" or "classify"); every other
# architecture is a generator (`--convert embed` turns a *ForCausalLM into an embedder).
POOLING_ARCHS: dict[str, str] = {
    "LlamaModel": "embed",
    "MistralModel": "embed",
    "Qwen2Model": "embed",
    "Qwen3Model": "embed",
    "LlamaForSequenceClassification": "classify",
    "MistralForSequenceClassification": "classify",
    "Qwen2ForSequenceClassification": "classify",
    "Qwen3ForSequenceClassification": "classify",
    "BertModel": "embed",
    "BertForSequenceClassification": "classify",
    "RobertaModel": "embed",
    "RobertaForSequenceClassification": "classify",
    "XLMRobertaModel": "embed",
    "XLMRobertaForSequenceClassification": "classify",
}

# Encoder-only architectures: the whole prompt in one step, bidirectional attention.
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
