"""`RankRecovery`: what one rank does when the pipeline recovers from a lost stage, beside the
step (which the `Worker` keeps).

- **Stage-local rebuild** (`replay_stages`): a replaced stage rebuilds its KV from the
  committed tokens; the stage before it sends the rows its boundary cache kept for them.
- **Merge** (`merge_layers`, `grow_merged_cache`, `replay_gained_layers`, `finish_merge`):
  a stage that could not be replaced left the pipeline and this rank's stage takes its
  layers (`vllm.worker.stage_merge`); the layers taken over are held here until their KV is
  replayed.

The executor's side is `vllm.executor.stage_control.StageControl`; every call arrives as a
verb of the rank's table (`vllm.distributed.rank_verbs`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from vllm.config import CacheConfig, ModelConfig, ParallelConfig
from vllm.distributed import parallel_state as ps
from vllm.distributed.pipeline_shape import PipelineShape
from vllm.model_executor.models.utils import StageLayout
from vllm.step_records import BlockOps, ExecuteModelRequest
from vllm.worker.cache_engine import CacheEngine
from vllm.worker.model_runner import ModelRunner
from vllm.worker.request_table import StepRows, replay_rows
from vllm.worker.stage_merge import GainedLayers, finish, load_gained, replay_gained

logger = logging.getLogger("vllm.worker")


class RecoveringRank(Protocol):
    """What a recovery uses of its rank (the `Worker`): its stage and the primitives of a
    step (block operations, the hidden states to and from the neighbours)."""

    rank: int
    device: torch.device
    layout: StageLayout
    cache_engine: CacheEngine | None
    model_runner: ModelRunner
    model_config: ModelConfig
    cache_config: CacheConfig

    @property
    def parallel_config(self) -> ParallelConfig: ...

    def set_shape(self, shape: PipelineShape) -> None: ...

    def stage_layout(self) -> StageLayout: ...

    def use_layers(self, layout: StageLayout, runner: ModelRunner) -> None: ...

    def num_kv_heads(self) -> int: ...

    def determine_num_available_blocks(self) -> tuple[int, int]: ...

    def apply_block_ops(self, kv_blocks_bound: int, ops: BlockOps) -> None: ...

    def leave_groups_after(self, exc: BaseException) -> None: ...

    def receive_hidden(self) -> dict[str, Any]: ...

    def send_hidden(self, to_send: dict[str, Any], send: bool = True) -> None: ...

    def send_to_next(self, to_send: dict[str, Any]) -> None: ...

    def wait_for_send(self) -> None: ...

    def drop_pending_send(self) -> None: ...


class RankRecovery:
    """One rank's part of a recovery (see the module docstring); owns the layers taken over
    from a lost neighbour until their KV is replayed."""

    def __init__(self, worker: RecoveringRank) -> None:
        self.worker = worker
        self.gained: GainedLayers | None = None

    def forget(self) -> None:
        """The stage took a new range (`Worker.reshape`): no merge is under way any more."""
        self.gained = None

    # -- a replaced stage's KV rebuilt from the committed tokens ---------------------------

    def replay_stages(self, request: ExecuteModelRequest) -> None:
        """One replay step of a stage-local rebuild (a step with a `ReplayPlan`, see
        `vllm.step_records.StepMessage`): a rebuilt stage runs its layers on the committed
        tokens (writing their KV and its own boundary rows) and passes them on to a rebuilt
        next stage; a kept stage whose next stage is rebuilt sends the rows its boundary
        cache holds for those slots; others only apply the block operations. Nothing is
        sampled, and the stage's request table is left as it was."""
        worker = self.worker
        plan = request.replay_plan("replay_stages")
        assert request.step is not None  # checked by replay_plan
        rows = replay_rows(request.step)
        for ops in plan.before:
            worker.apply_block_ops(request.kv_blocks_bound, ops)
        if rows.groups:
            pp_rank = ps.get_pipeline_model_parallel_rank()
            rebuilt = set(plan.rebuild_stages)
            next_rebuilt = pp_rank + 1 in rebuilt and not worker.layout.is_last
            try:
                self._replay(rows, pp_rank in rebuilt, next_rebuilt)
            except BaseException as exc:
                worker.leave_groups_after(exc)
                raise
        # The rows it wrote (KV, boundary) are complete and its sends done.
        for ops in plan.after:
            worker.apply_block_ops(request.kv_blocks_bound, ops)

    @torch.inference_mode()
    def _replay(self, rows: StepRows, rebuilt: bool, next_rebuilt: bool) -> None:
        worker = self.worker
        cache = worker.cache_engine
        assert cache is not None, "initialize_cache() first"
        try:
            if rebuilt:
                received = None if worker.layout.is_first else worker.receive_hidden()
                to_send = worker.model_runner.replay_stage(cache.gpu_cache, rows, received)
                if to_send is not None:
                    worker.send_hidden(to_send, send=next_rebuilt)
            elif next_rebuilt:
                to_send = worker.model_runner.replay_inputs(rows)
                to_send["hidden"] = cache.read_boundary(to_send["md.slot_mapping"])
                if worker.parallel_config.tensor_parallel_size > 1:
                    # Kept as sent: this rank's slice (see `Worker.boundary_width`).
                    width = worker.model_config.get_hidden_size()
                    if to_send["hidden"].shape[-1] < width:
                        to_send["hidden_tp_sliced"] = True
                worker.wait_for_send()
                worker.send_to_next(to_send)
            worker.wait_for_send()
        finally:
            worker.drop_pending_send()

    # -- taking over a lost neighbour's layers (vllm.worker.stage_merge) --------------------

    def merge_layers(
        self, shape: PipelineShape, lost: tuple[int, int, bool, bool]
    ) -> tuple[int, int] | None:
        """The pipeline lost a stage (its `StageLayout` fields: `lost`) and ONE neighbour
        takes its layers (the split of `shape`). A stage whose range is unchanged keeps
        everything and returns None; the one taking them loads only them (its own module,
        KV, swap copies and boundary rows stay) and returns the (device, host) blocks it can
        hold with its new layers, like `Worker.determine_num_available_blocks`. Its cache
        grows in `grow_merged_cache`."""
        worker = self.worker
        worker.set_shape(shape)
        old, new = worker.layout, worker.stage_layout()
        if new == old:
            return None
        lost_layout = StageLayout(*lost)
        default_shape = (worker.num_kv_heads(), worker.model_config.get_head_size())
        runner, self.gained = load_gained(
            worker.model_config, worker.model_runner.model, old, lost_layout, new,
            worker.cache_config.block_size, worker.device, default_shape,
        )  # fmt: skip
        worker.use_layers(new, runner)
        logger.info(
            "rank %d: layers [%d, %d) -> [%d, %d) (took over [%d, %d): loaded only those)",
            worker.rank, old.start_layer, old.end_layer, new.start_layer, new.end_layer,
            lost_layout.start_layer, lost_layout.end_layer,
        )  # fmt: skip
        return worker.determine_num_available_blocks()

    def grow_merged_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The stage that took over layers (`merge_layers`): KV tensors for them, device and
        host, and every tensor at the engine's (possibly smaller) block counts."""
        worker, gained = self.worker, self.gained
        cache = worker.cache_engine
        if gained is None or cache is None:
            raise RuntimeError(f"rank {worker.rank}: grow_merged_cache before merge_layers")
        model = gained.runner.model
        if hasattr(model, "kv_cache_shapes"):
            shapes = list(model.kv_cache_shapes())
        else:
            shape = (worker.num_kv_heads(), worker.model_config.get_head_size())
            shapes = [shape] * gained.runner.layout.num_layers
        gained.kv = cache.add_layers(shapes, gained.before, num_gpu_blocks, num_cpu_blocks)
        if cache.gpu_boundary is not None and not worker.layout.is_last and not gained.before:
            # Made here, outside inference mode: it becomes the boundary cache, written
            # by every later step.
            gained.boundary_out = cache.empty_boundary()

    def replay_gained_layers(self, request: ExecuteModelRequest) -> None:
        """One replay step of the layers this stage took over (`vllm.worker.stage_merge`):
        every rank applies the block operations (as `replay_stages`); the stage that took
        them runs only them on the committed tokens from data it holds. Nothing is sent or
        sampled."""
        plan = request.replay_plan("replay_gained_layers")
        assert request.step is not None  # checked by replay_plan
        rows = replay_rows(request.step)
        worker = self.worker
        cache = worker.cache_engine
        assert cache is not None, "initialize_cache() first"
        for ops in plan.before:
            worker.apply_block_ops(request.kv_blocks_bound, ops)
        if rows.groups and self.gained is not None:
            try:
                replay_gained(self.gained, cache, rows, worker.model_config.get_hidden_size())
            except BaseException as exc:
                worker.leave_groups_after(exc)
                raise
        for ops in plan.after:
            worker.apply_block_ops(request.kv_blocks_bound, ops)

    def finish_merge(self) -> None:
        """The layers taken over have their KV: the boundary cache holds what this stage
        sends downstream now (none on a stage that became the last one)."""
        gained, self.gained = self.gained, None
        cache = self.worker.cache_engine
        if gained is not None and cache is not None:
            finish(gained, cache, self.worker.layout.is_last)
