"""Tiny random-weight MoE checkpoints (Mixtral, Qwen3-MoE) saved by HF transformers with the
test tokenizer, as tiny_models.py does for the dense families (weights std 0.08, norms
1 + 0.1 N(0, 1), fixed seed): well separated logits and routing.

  mixtral    4 layers, 4 experts, top-2 (renormalised)
  qwen3_moe  4 layers, 8 experts, top-2 (not renormalised), head_dim 32 != hidden / heads,
             layer 2 dense (`mlp_only_layers`, intermediate 128; the experts' is 96)
"""

from __future__ import annotations

from typing import Any

import torch

from tests.utils.tiny_models import build_dirs, save_random_model

KINDS = ("mixtral", "qwen3_moe")
H, INTER, EXPERTS, TOP_K, LAYERS = 64, 96, 4, 2, 4
QWEN3_MOE_DENSE_LAYERS = [2]


def randomise(module: torch.nn.Module, seed: int) -> None:
    """std 0.08 weights (norms 1 +- 0.1), as save_random_model draws them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))


def mixtral_config(**overrides: Any) -> Any:
    """The tiny Mixtral's HF config (`overrides` change its fields)."""
    from transformers import MixtralConfig

    fields: dict[str, Any] = dict(
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        sliding_window=None,
    )
    fields.update(overrides)
    return MixtralConfig(**fields)


def qwen3_moe_config() -> Any:
    """The tiny Qwen3-MoE's HF config."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=H,
        intermediate_size=128,  # the dense layer's
        moe_intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=False,
        mlp_only_layers=QWEN3_MOE_DENSE_LAYERS,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )


def build_moe(kind: str, out_dir: str, tokenizer_dir: str) -> str:
    """Create, randomise (seed 0) and save one tiny MoE model with the tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = mixtral_config() if kind == "mixtral" else qwen3_moe_config()
    config.vocab_size = len(tokenizer)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    return save_random_model(config, out_dir, tokenizer)


def moe_dirs(root: str) -> dict[str, str]:
    """Build (once per root) the tokenizer and both tiny MoE models; returns kind -> directory."""
    return build_dirs(root, KINDS, build_moe)
