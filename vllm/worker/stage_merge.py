"""A stage that takes over a lost neighbour's layers (PP N -> N-1, a shrink:
`vllm.resilience.plans.shrink`) and rebuilds only their KV, from data it holds itself.

The stage keeps its own layers' module, KV, swap copies and boundary rows; it loads only the
gained layers, as a module built for the lost stage's layout (`StageChain` runs both), and
gets new KV tensors for them (`CacheEngine.add_layers`). Their KV is then replayed on the
committed tokens (`replay_gained`): when the previous stage took the layers, on its own
boundary rows (what it sent the lost stage), its boundary rows then replaced by the gained
layers' output (what it sends its new next stage; `finish`) unless it is now the last
stage; when the next stage took the first stage's layers, on the token ids (embedding
included), its own KV and boundary rows staying as they are. Nothing is sent between
stages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.layers.attention import KVCache
from vllm.model_executor.models.stage_chain import StageChain
from vllm.model_executor.models.utils import StageLayout
from vllm.model_executor.weight_utils import load_stage_model
from vllm.worker.cache_engine import CacheEngine
from vllm.worker.model_runner import ModelRunner
from vllm.worker.request_table import StepRows


@dataclass
class GainedLayers:
    """The layers a stage took over, while their KV is being replayed."""

    runner: ModelRunner  # runs the gained module alone, laid out as the lost stage was
    before: bool  # the gained layers come before the stage's own (the first stage was lost)
    kv: list[KVCache]  # their device caches (set once the cache grew)
    # The gained layers' output rows, the stage's boundary cache once the replay is over
    # (`finish`). Not written in place: a block shared by several sequences (a cached
    # prefix, forked samples) is replayed once per sequence, maybe in a later step, and
    # each must read the rows the stage sent before the merge.
    boundary_out: torch.Tensor | None = None


def load_gained(
    model_config: Any,
    own: nn.Module,
    own_layout: StageLayout,
    lost: StageLayout,
    new_layout: StageLayout,
    block_size: int,
    device: torch.device,
    default_kv_shape: tuple[int, int],
) -> tuple[ModelRunner, GainedLayers]:
    """Load the `lost` stage's layers (only their tensors) and build the stage's runner for
    `new_layout`: its `own` module and the gained one chained in layer order. Returns (the
    new runner, the gained layers to replay)."""
    gained = load_stage_model(model_config, lost, device)
    before = lost.end_layer <= own_layout.start_layer
    parts = [gained, own] if before else [own, gained]
    chain = StageChain(parts, default_kv_shape)
    runner = ModelRunner(chain, new_layout, block_size, device, model_config)
    gained_runner = ModelRunner(gained, lost, block_size, device, model_config)
    return runner, GainedLayers(gained_runner, before, [])


@torch.inference_mode()
def replay_gained(
    gained: GainedLayers, cache: CacheEngine, rows: StepRows, hidden_size: int
) -> None:
    """One replay step: the gained layers on prefill chunks of committed tokens, writing
    their KV (see the module docstring)."""
    runner = gained.runner
    if runner.layout.is_first:
        # From the token ids; the output is what the stage itself computed from already.
        runner.replay_stage(gained.kv, rows, None)
        return
    received = runner.replay_inputs(rows)
    slots = received["md.slot_mapping"]
    # Read before the chunk's rows are overwritten below (a copy: index_select).
    hidden = cache.read_boundary(slots)  # [T, H / tp] or [T, H]
    if hidden.shape[-1] < hidden_size:  # kept as sent: this TP rank's slice
        hidden = tpu.all_gather_last_dim(hidden)  # [T, H]
    received["hidden"] = hidden
    to_send = runner.replay_stage(gained.kv, rows, received)
    if to_send is not None:  # not the last stage: what goes downstream from now on
        sent, _ = tpu.slice_for_next_stage(to_send["hidden"])  # [T, H / tp] or [T, H]
        assert gained.boundary_out is not None, "grow_merged_cache first"
        flat = gained.boundary_out.view(-1, gained.boundary_out.shape[-1])  # [blocks*bs, W]
        flat.index_copy_(0, slots.to(flat.device), sent.to(flat.dtype))


def finish(gained: GainedLayers, cache: CacheEngine, is_last: bool) -> None:
    """The replay is over: the gained layers' output rows become the boundary cache (the
    slots not replayed hold nothing in use), or a stage that became the last one keeps no
    boundary rows (it sends nothing downstream)."""
    if is_last:
        cache.drop_boundary()
    elif gained.boundary_out is not None:
        cache.gpu_boundary = gained.boundary_out
