"""A PEFT LoRA adapter's `adapter_config.json`, read and checked without torch (the engine
refuses a bad adapter before any stage loads it)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine needs of an adapter: its rank and its scaling (`lora_alpha / r`, or
    `lora_alpha / sqrt(r)` with `use_rslora`)."""

    rank: int
    lora_alpha: float
    scaling: float


# vLLM's wording (its LoRA model manager's warning for MoE models), said as an error here: an
# adapter of the experts would otherwise be applied partly or not at all.
EXPERT_LORA_UNSUPPORTED = (
    "expert LoRA is not supported: for MoE models, vLLM currently does not support fused MoE "
    "LoRA inference. Please ensure that the loaded LoRA model does not contain expert weights."
)
# Module names of MoE experts and routers, as PEFT names them: per-expert linears
# (`experts.N.w1`, `experts.N.gate_proj`), stacked expert parameters (`experts`,
# `experts.base_layer`), shared experts, and the router (`mlp.gate`, `block_sparse_moe.gate`).
_EXPERT_RE = re.compile(
    r"(^|\.)(experts|shared_experts?|shared_expert_gate)(\.|$)"
    r"|(^|\.)(w1|w2|w3)$"
    r"|(^|\.)(mlp|block_sparse_moe)\.(gate|router)$"
)


def is_expert_module(name: str) -> bool:
    """Whether an HF module name (e.g. `model.layers.0.block_sparse_moe.experts.3.w1`) is an MoE
    expert, shared expert or router."""
    return _EXPERT_RE.search(name) is not None


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
    if config.get("target_parameters"):
        # PEFT's LoRA on raw parameters: on an MoE model, the stacked expert weights.
        raise ValueError(
            f"adapter {path}: target_parameters {config['target_parameters']} are not "
            f"supported; {EXPERT_LORA_UNSUPPORTED}"
        )
    # vLLM's messages (its PEFTHelper's checks).
    if config.get("modules_to_save"):
        raise ValueError(
            f"adapter {path}: vLLM only supports modules_to_save being None (got "
            f"{config['modules_to_save']}: only low-rank updates of the linear layers are "
            "applied)."
        )
    if config.get("use_dora"):
        raise ValueError(f"adapter {path}: vLLM does not yet support DoRA.")
    if config.get("bias", "none") not in (None, "none") or config.get("lora_bias"):
        raise ValueError(f"adapter {path}: Adapter bias cannot be used without bias_enabled.")
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
