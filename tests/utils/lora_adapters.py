"""PEFT LoRA adapters for the tiny test models, and HF's greedy outputs with them applied.

PEFT initialises lora_B to zero (an adapter that changes nothing): the adapters here get random
A and B (std 0.05 for B, 0.1 for A) so every adapter changes the greedy outputs."""

from __future__ import annotations

import os
from typing import Any

import torch

# name -> (rank, lora_alpha, target modules, use_rslora, seed)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, tuple[int, int, list[str], bool, int]] = {
    "a4": (4, 8, LLAMA_TARGETS, False, 1),
    "b8": (8, 16, ["q_proj", "v_proj", "down_proj"], False, 2),
    "c8": (8, 4, ["k_proj", "o_proj", "gate_proj", "up_proj"], True, 3),
    "d4": (4, 16, ["q_proj", "o_proj", "up_proj", "down_proj"], False, 4),
}


def make_adapter(
    model_dir: str,
    out_dir: str,
    rank: int,
    alpha: int,
    targets: list[str],
    use_rslora: bool = False,
    seed: int = 0,
    **extra: Any,
) -> str:
    """Save a PEFT LoRA adapter of `model_dir` with random non-zero A and B."""
    from peft import LoraConfig, get_peft_model

    from tests.utils.tiny_models import load_hf

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
        **extra,
    )
    model = get_peft_model(load_hf(model_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out_dir)
    return out_dir


def make_adapters(model_dir: str, root: str, names: Any = ADAPTERS) -> dict[str, str]:
    """Each adapter of `names` for `model_dir`, saved under `root` (built once)."""
    dirs = {}
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            rank, alpha, targets, rslora, seed = ADAPTERS[name]
            make_adapter(model_dir, path, rank, alpha, targets, rslora, seed)
        dirs[name] = path
    return dirs


def hf_lora_greedy(
    model_dir: str, adapter_dir: str | None, prompts: list[str], max_new_tokens: int
) -> list[list[int]]:
    """HF transformers' greedy continuations with the adapter applied (PeftModel), or of the
    base model when adapter_dir is None."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from tests.utils.tiny_models import hf_greedy_with, load_hf

    model = load_hf(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return hf_greedy_with(model, tokenizer, prompts, max_new_tokens)
