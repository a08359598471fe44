"""PEFT LoRA adapters for the tiny test models, and HF's greedy outputs with them applied.

PEFT initialises lora_B to zero (an adapter that changes nothing): the adapters here get random
A and B (std 0.05 for B, 0.1 for A) so every adapter changes the greedy outputs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def peft_targets_as_named() -> Iterator[None]:
    """PEFT (on transformers 5) rewrites the targets of a Mixtral / Qwen-MoE adapter as if it
    were written for transformers 4: `gate_proj` / `up_proj` / `down_proj` become the stacked
    expert parameters, even where only a dense layer (Qwen3-MoE's `mlp_only_layers`) has
    modules of those names. Inside this block PEFT targets the modules the adapter names, both
    when it makes an adapter and when HF applies one (PeftModel)."""
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def make_adapter(
    model_dir: str,
    out_dir: str,
    rank: int,
    alpha: int,
    targets: list[str],
    use_rslora: bool = False,
    seed: int = 0,
    load: Callable[[str], Any] | None = None,
    **extra: Any,
) -> str:
    """Save a PEFT LoRA adapter of `model_dir` (loaded by `load`, default tiny_models.load_hf)
    with random non-zero A and B."""
    from peft import LoraConfig, get_peft_model

    from tests.utils import tiny_models

    load_hf = load or tiny_models.load_hf

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
    model_dir: str,
    adapter_dir: str | None,
    prompts: list[str],
    max_new_tokens: int,
    load: Callable[[str], Any] | None = None,
    merged: bool = False,
) -> list[list[int]]:
    """HF transformers' greedy continuations with the adapter applied (PeftModel; with `merged`,
    folded into the base weights by `merge_and_unload`), or of the base model when adapter_dir
    is None; `load` as in make_adapter (Gemma: eager attention)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from tests.utils import tiny_models
    from tests.utils.tiny_models import hf_greedy_with

    model = (load or tiny_models.load_hf)(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
        if merged:
            model = model.merge_and_unload().eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return hf_greedy_with(model, tokenizer, prompts, max_new_tokens)


def write_adapter(
    out_dir: str,
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    targets: list[str],
    alpha: int = 8,
) -> str:
    """Save an adapter in PEFT's layout from HF module names -> (A [r, in], B [out, r]): for
    layouts PEFT no longer writes (a transformers 4 Mixtral's per-expert `w1`/`w2`/`w3`)."""
    import json

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for module, (a, b) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return out_dir
