"""Shared pieces of the stage-local model modules: the stage layout and weight-name routing."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from vllm.model_executor.layers.quantization import gguf as gguf_quant

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class StageLayout:
    """The slice of the model one pipeline stage owns: decoder layers `[start, end)`, plus the
    embeddings on the first stage and the final norm / lm_head on the last."""

    start_layer: int
    end_layer: int
    is_first: bool
    is_last: bool

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer


def layer_index(name: str) -> int | None:
    """Global decoder-layer index in a checkpoint tensor name, or None for non-layer tensors."""
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def localize_layer_name(name: str, layout: StageLayout) -> str | None:
    """Rename `...layers.<global>.` to `...layers.<local>.`; None if another stage owns it."""
    idx = layer_index(name)
    if idx is None:
        return name
    if not layout.start_layer <= idx < layout.end_layer:
        return None
    return name.replace(f".layers.{idx}.", f".layers.{idx - layout.start_layer}.", 1)


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one TP rank loads: `size` indices of dimension `dim`
    from `start` (fewer at the end of the tensor: the last vocabulary shard)."""

    dim: int
    start: int
    size: int

    def narrow(self, tensor: torch.Tensor) -> torch.Tensor:
        """This shard of a whole tensor (a view)."""
        end = min(self.start + self.size, tensor.shape[self.dim])
        return tensor.narrow(self.dim, self.start, end - self.start)


def copy_padded_rows(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy a vocabulary shard into the first rows of its parameter and zero the padding rows
    (the last TP rank's shard is shorter than ceil(vocab / tp))."""
    rows = loaded.shape[0]
    copy_weight(param[:rows], loaded, name)
    if rows < param.shape[0]:
        with torch.no_grad():
            param[rows:].zero_()


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), checking the shape.
    GGUF blocks go to a quantized weight's collector (--quantization gguf), or are
    dequantized for a dense parameter."""
    if gguf_quant.load_into(param, loaded, name):
        return
    loaded = gguf_quant.dense(loaded)
    if param.shape != loaded.shape:
        raise ValueError(
            f"weight {name}: checkpoint shape {tuple(loaded.shape)} does not match the model's "
            f"{tuple(param.shape)}."
        )
    with torch.no_grad():
        param.copy_(loaded.to(param.dtype))


def load_stacked(
    params: dict[str, nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    stacked: list[tuple[str, str, int, int]],
) -> str | None:
    """Load a q/k/v (or gate/up) checkpoint tensor into its rows of a fused parameter.

    `stacked` lists (fused_name, shard_name, row_start, row_count). Returns the fused
    parameter's name if handled, else None.
    """
    for fused, shard, row_start, rows in stacked:
        if f".{shard}." not in name:
            continue
        target = name.replace(f".{shard}.", f".{fused}.")
        if target not in params:
            return None
        copy_weight(params[target][row_start : row_start + rows], tensor, name)
        return target
    return None


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    """Every parameter of this stage must have come from the checkpoint."""
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")
