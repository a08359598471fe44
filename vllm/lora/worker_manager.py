"""`StageLoRAManager`: one stage's adapters. Installs the LoRA wrappers, keeps the registered
adapters (`max_cpu_loras` of them loaded, least recently used evicted and read again from
their directory when needed), puts a step's adapters into the `max_loras` slots (swapping out
the least recently used one no token of the step needs) and maps the step's tokens to slots.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch import nn

from vllm.config import LoRAConfig
from vllm.lora.layers import LoRAContext, install_lora_layers
from vllm.lora.peft_loader import LoRAWeights, load_lora_weights
from vllm.lora.request import LoRARequest
from vllm.model_executor.models.utils import StageLayout
from vllm.sequence import SequenceGroupMetadata


class StageLoRAManager:
    """The adapters of one stage (one rank): registry, CPU cache, slots, step mapping."""

    def __init__(
        self,
        model: nn.Module,
        layout: StageLayout,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.layout = layout
        self.config = config
        self.dtype = dtype
        self.device = device
        self.context = LoRAContext()
        self.layers = install_lora_layers(
            model, self.context, config.max_loras, config.max_lora_rank, dtype, device
        )
        self.known: dict[int, LoRARequest] = {}
        # Loaded adapters, least recently used first (at most max_cpu_loras).
        self.cache: collections.OrderedDict[int, LoRAWeights] = collections.OrderedDict()
        # Adapter id -> slot, least recently used first; free slots.
        self.slots: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.free_slots = list(range(config.max_loras))

    # -- registry ---------------------------------------------------------------------------

    def add(self, request: LoRARequest) -> bool:
        """Register and load an adapter (False if its id is registered already)."""
        if request.lora_int_id in self.known:
            return False
        weights = load_lora_weights(request, self.model, self.layers, self.layout, self.dtype)
        if weights.rank > self.config.max_lora_rank:
            raise ValueError(
                f"LoRA rank {weights.rank} is greater than max_lora_rank "
                f"{self.config.max_lora_rank}."
            )
        self.known[request.lora_int_id] = request
        self._cache_put(weights)
        return True

    def remove(self, lora_id: int) -> bool:
        if self.known.pop(lora_id, None) is None:
            return False
        self.cache.pop(lora_id, None)
        slot = self.slots.pop(lora_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(slot)
            self.free_slots.append(slot)
        return True

    def ids(self) -> list[int]:
        return sorted(self.known)

    def _cache_put(self, weights: LoRAWeights) -> None:
        self.cache[weights.lora_int_id] = weights
        self.cache.move_to_end(weights.lora_int_id)
        while len(self.cache) > (self.config.max_cpu_loras or self.config.max_loras):
            self.cache.popitem(last=False)

    def _weights(self, lora_id: int) -> LoRAWeights:
        weights = self.cache.get(lora_id)
        if weights is None:
            request = self.known.get(lora_id)
            if request is None:
                raise RuntimeError(f"LoRA adapter {lora_id} is not registered on this stage")
            weights = load_lora_weights(request, self.model, self.layers, self.layout, self.dtype)
        self._cache_put(weights)
        return weights

    # -- a step ----------------------------------------------------------------------------

    def _slot_for(self, lora_id: int, step_ids: set[int]) -> int:
        slot = self.slots.get(lora_id)
        if slot is not None:
            self.slots.move_to_end(lora_id)
            return slot
        if self.free_slots:
            slot = self.free_slots.pop(0)
        else:
            victim = next((i for i in self.slots if i not in step_ids), None)
            if victim is None:
                raise RuntimeError(
                    f"a step uses {len(step_ids)} LoRA adapters, more than max_loras "
                    f"({self.config.max_loras})"
                )
            slot = self.slots.pop(victim)
        weights = self._weights(lora_id)
        for name, layer in self.layers.items():
            layer.set_slot(slot, weights.modules.get(name, {}), weights.scaling)
        self.slots[lora_id] = slot
        return slot

    def activate(self, token_lora_ids: torch.Tensor) -> None:
        """token_lora_ids [T] (0: base model): load the step's adapters into slots and give
        the wrapped layers each token's slot (once per step; the layers share it)."""
        ids = token_lora_ids.tolist()
        step_ids = set(ids) - {0}
        if not step_ids:
            self.context.clear()  # the base model alone: the layers skip the update
            return
        slot_of = {lora_id: self._slot_for(lora_id, step_ids) for lora_id in sorted(step_ids)}
        slot_of[0] = -1
        self.context.set_slots([slot_of[i] for i in ids], token_lora_ids.device)

    def clear(self) -> None:
        self.context.clear()


def token_lora_ids(
    layout: list[SequenceGroupMetadata], prefill_lens: list[int], device: Any
) -> torch.Tensor:
    """Each input token's adapter id [T] (0: none), in `prepare_inputs`' order (`layout`:
    prefills first): the prompt tokens of every prefilling sequence (`prefill_lens` of
    each), then the decode rows: a speculative sequence's last token and drafts, one per
    plain decoding sequence."""
    ids: list[int] = []
    lens = iter(prefill_lens)
    for meta in layout:
        if meta.is_prompt:
            for _ in meta.seq_data:
                ids.extend([meta.lora_int_id] * next(lens))
        elif meta.draft_token_ids is not None:
            for seq_id in meta.seq_data:
                rows = 1 + len(meta.draft_token_ids.get(seq_id, []))
                ids.extend([meta.lora_int_id] * rows)
        else:
            ids.extend([meta.lora_int_id] * len(meta.seq_data))
    return torch.tensor(ids, dtype=torch.long, device=device)
