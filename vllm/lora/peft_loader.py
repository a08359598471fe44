"""One PEFT LoRA adapter's tensors for one pipeline stage and TP rank.

PEFT names a tensor `base_model.model.<HF module>.lora_A.weight` (A [r, in]) or `.lora_B.weight`
(B [out, r]). A stage keeps only the modules of its own decoder layers (renamed to its local
layer indices) and maps each HF module to the wrapped layer and slice that computes it (q/k/v
to the fused qkv_proj, gate/up to gate_up_proj; a checkpoint's own fused module, as Phi-3's,
to the whole layer). TP shards follow the base weights (the model's `weight_shard`):
column-parallel layers cut B's output rows, row-parallel layers cut A's input columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.lora.layers import LoRALinear
from vllm.lora.peft_config import (
    EXPERT_LORA_UNSUPPORTED,
    adapter_weights_file,
    is_expert_module,
    read_adapter_config,
)
from vllm.lora.request import LoRARequest
from vllm.model_executor.models.utils import Shard, StageLayout, localize_layer_name
from vllm.model_executor.weight_utils import read_sharded

_PREFIX = "base_model.model."


@dataclass
class LoRAWeights:
    """An adapter's weights on this stage: wrapped layer name -> {slice: (A [r, in_local],
    B [out_slice_local, r])}, plus its rank and scaling."""

    lora_int_id: int
    rank: int
    scaling: float
    modules: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def module_lookup(layers: dict[str, LoRALinear]) -> dict[str, tuple[str, int]]:
    """Stage-local HF module name -> (wrapped layer name, slice index)."""
    lookup: dict[str, tuple[str, int]] = {}
    for name, layer in layers.items():
        parent = name.rsplit(".", 1)[0]
        for index, slice_name in enumerate(layer.slice_names):
            lookup[f"{parent}.{slice_name}"] = (name, index)
        # The fused module by its own name: one A/B over every slice (slice 0's block).
        lookup.setdefault(name, (name, 0))
    return lookup


def _read_tensors(file: str) -> dict[str, torch.Tensor]:
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(file)
    return torch.load(file, map_location="cpu", weights_only=True)


def _parse_key(key: str) -> tuple[str, str]:
    """(HF module name, "lora_A" or "lora_B") of a PEFT tensor name; ("", key) otherwise."""
    name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
    for part in ("lora_A", "lora_B"):
        for suffix in (f".{part}.weight", f".{part}.default.weight"):
            if name.endswith(suffix):
                return name[: -len(suffix)], part
    return "", name


def _cut(tensor: torch.Tensor, spec: Any, dim: int) -> torch.Tensor:
    """This rank's part of an A (dim 1: row-parallel input columns) or B (dim 0:
    column-parallel output rows); untouched when the base weight is not cut along `dim`."""
    if spec is None:
        return tensor
    shards = [spec] if isinstance(spec, Shard) else list(spec)
    if shards[0].dim != dim:
        return tensor
    return read_sharded(spec, lambda one: one.narrow(tensor))


def load_lora_weights(
    request: LoRARequest,
    model: Any,
    layers: dict[str, LoRALinear],
    layout: StageLayout,
    dtype: torch.dtype,
) -> LoRAWeights:
    """Read `request`'s adapter: this stage's modules, this TP rank's shards, in `dtype`.
    An adapter targeting a module the engine does not adapt is a ValueError (vLLM's); one of
    MoE experts or routers says so, on every stage (checked by name, whichever stage holds
    the layer)."""
    path = request.lora_path
    config = read_adapter_config(path)
    lookup = module_lookup(layers)
    supported = {name.rsplit(".", 1)[-1] for name in lookup}
    tensors = _read_tensors(adapter_weights_file(path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    unexpected: set[str] = set()
    experts = sorted({m for m, _ in map(_parse_key, tensors) if m and is_expert_module(m)})
    if experts:
        shown = ", ".join(experts[:4]) + (
            f" and {len(experts) - 4} more" if len(experts) > 4 else ""
        )
        raise ValueError(
            f"While loading {path}, expected target modules in {sorted(supported)} but "
            f"received MoE expert or router modules ({shown}): {EXPERT_LORA_UNSUPPORTED}"
        )
    for key, tensor in tensors.items():
        module, part = _parse_key(key)
        if not module or module.rsplit(".", 1)[-1] not in supported:
            unexpected.add((module or part).rsplit(".", 1)[-1])
            continue
        pairs.setdefault(module, {})[part] = tensor
    for module in pairs:
        local = localize_layer_name(module + ".weight", layout)
        if local is not None and local[: -len(".weight")] not in lookup:
            unexpected.add(module)
    if unexpected:
        raise ValueError(
            f"While loading {path}, expected target modules in {sorted(supported)} but "
            f"received {sorted(unexpected)}. Please verify that the loaded LoRA module is "
            "correct"
        )
    weights = LoRAWeights(request.lora_int_id, config.rank, config.scaling)
    for module, parts in pairs.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise ValueError(f"While loading {path}: {module} lacks lora_A or lora_B.")
        local = localize_layer_name(module + ".weight", layout)
        if local is None:
            continue  # another stage's layer
        layer_name, index = lookup[local[: -len(".weight")]]
        spec = model.weight_shard(module + ".weight")
        a = _cut(parts["lora_A"], spec, 1).to(dtype).contiguous()  # [r, in_local]
        b = _cut(parts["lora_B"], spec, 0).to(dtype).contiguous()  # [out_local, r]
        if a.shape[0] != config.rank or b.shape[1] != config.rank:
            raise ValueError(
                f"While loading {path}: {module} has rank {a.shape[0]}, adapter_config.json "
                f"says r={config.rank}."
            )
        weights.modules.setdefault(layer_name, {})[index] = (a, b)
    return weights
