"""A PEFT LoRA adapter's `adapter_config.json`, read and checked without torch (the engine
refuses a bad adapter before any stage loads it)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine needs of an adapter: its rank and its scaling (`lora_alpha / r`, or
    `lora_alpha / sqrt(r)` with `use_rslora`)."""

    rank: int
    lora_alpha: float
    scaling: float


def adapter_weights_file(path: str) -> str:
    """The adapter's tensor file: `adapter_model.safetensors`, else `adapter_model.bin`."""
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            return file
    raise ValueError(
        f"No adapter found for {path}: expected adapter_model.safetensors or adapter_model.bin"
    )


def read_adapter_config(path: str) -> AdapterConfig:
    """Read and check `path`/adapter_config.json (a PEFT LoRA adapter)."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"No adapter found for {path}: adapter_config.json is missing")
    with open(file) as f:
        config = json.load(f)
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"adapter {path}: peft_type {peft_type!r} is not supported (only LORA).")
    if config.get("modules_to_save"):
        raise ValueError(
            f"adapter {path}: modules_to_save {config['modules_to_save']} is not supported "
            "(only low-rank updates of the linear layers are applied)."
        )
    for key in ("use_dora", "lora_bias"):
        if config.get(key):
            raise ValueError(f"adapter {path}: {key}=True is not supported.")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"adapter {path}: a per-module {key} is not supported.")
    if config.get("layers_to_transform") is not None:
        raise ValueError(f"adapter {path}: layers_to_transform is not supported.")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {path}: r must be a positive int, got {rank!r}.")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter_weights_file(path)
    return AdapterConfig(rank, alpha, scaling)
