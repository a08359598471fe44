"""Tiny random-weight Gemma 2 and Gemma 3 (text) checkpoints saved by HF, and their HF greedy
references (eager attention: HF's only attention with soft-capping for Gemma 2).

Both have 7 layers, so that with PP = 2 (4/3) and PP = 3 (3/2/2, uneven) every stage holds
local (sliding-window) and global layers; windows of 8 and 12 tokens, shorter than most test
prompts and than prompt + 32 generated tokens; head_dim 32 independent of hidden/heads (64/4);
GQA (4 heads, 2 KV heads). Gemma 2's attention soft-cap is small (2.0) so that it changes the
greedy output; the final soft-cap (5.0) does not change an argmax, it shows in logprobs.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.utils.tiny_models import build_dirs

KINDS = ("gemma2", "gemma3")
NUM_LAYERS = 7
S, F = "sliding_attention", "full_attention"
# Gemma 3's local:global pattern, cut so every stage of the tested splits has both.
GEMMA3_LAYER_TYPES = [S, S, F, S, F, S, F]


def _config(kind: str, tokenizer: Any, **overrides: Any) -> Any:
    from transformers import Gemma2Config, Gemma3TextConfig

    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    if kind == "gemma2":
        cfg = dict(
            common,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        cfg.update(overrides)
        return Gemma2Config(**cfg)
    cfg = dict(
        common,
        query_pre_attn_scalar=40,
        sliding_window=12,
        layer_types=GEMMA3_LAYER_TYPES,
        final_logit_softcapping=5.0,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    )
    cfg.update(overrides)
    return Gemma3TextConfig(**cfg)


def build_gemma(
    kind: str, out_dir: str, tokenizer_dir: str, seed: int = 0, **overrides: Any
) -> str:
    """Create, randomise (std 0.08; norm offsets std 0.1, fixed seed) and save a tiny Gemma;
    `overrides` change the config fields above (e.g. layer_types=None: HF's default)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = _config(kind, tokenizer, **overrides)
    config.architectures = ["Gemma2ForCausalLM" if kind == "gemma2" else "Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Gemma norms hold w in (1 + w): a small offset around 0.
            std = 0.1 if "norm" in name else 0.08
            param.copy_(std * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def gemma_dirs(root: str) -> dict[str, str]:
    """Build (once per root) the tokenizer and both tiny Gemmas; returns kind -> directory."""
    return build_dirs(root, KINDS, build_gemma)


def load_hf(model_dir: str, **config_overrides: Any) -> Any:
    """The HF model of a saved directory, float32, eager attention, eval mode: the oracle.
    `config_overrides` change the config (e.g. sliding_window=None, to show a test that the
    window matters)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
