"""The record of the pipeline's size while it shrinks and grows back: the size it was
configured with, the split to grow back to, when growing back is tried next, and every resize
(`PipelineResizeEvent`); and what follows a resize on the engine's side. The one owner of that
state: the shrink and grow plans (`plans/shrink.py`, `plans/grow.py`) go through it.
Imports no torch."""

from __future__ import annotations

import time

from vllm import envs
from vllm.resilience.engine_control import EngineControl
from vllm.resilience.events import PipelineResizeEvent
from vllm.resilience.plans.reshape import PipelineReshaper


def regrow_interval_s() -> float:
    return envs.get_float("VLLM_PP_REGROW_INTERVAL_S")


class PipelineResizes:
    """The configured pipeline size, the split to grow back to, the resizes done."""

    def __init__(self, engine: EngineControl, reshaper: PipelineReshaper) -> None:
        self.engine = engine
        self.reshaper = reshaper
        pc = engine.parallel_config
        self.configured_pp = pc.pipeline_parallel_size
        # The split to go back to (the one in effect when the first stage was lost).
        self.restore_partition = pc.pp_layer_partition
        self._next_grow_at = 0.0  # time.monotonic() before which no automatic grow starts
        self.events: list[PipelineResizeEvent] = []

    @property
    def missing_stages(self) -> int:
        """Stages the pipeline lacks compared with its configured size."""
        return self.configured_pp - self.engine.parallel_config.pipeline_parallel_size

    def describe_missing(self) -> str:
        """What `/health` says while stages are missing."""
        pp = self.engine.parallel_config.pipeline_parallel_size
        return (
            f"running at pipeline_parallel_size={pp} of {self.configured_pp}: a failed stage "
            f"could not be replaced; growing back is tried every {regrow_interval_s():g} s"
        )

    def before_shrink(self) -> None:
        """A stage is about to leave: from the configured size, its split is the one to grow
        back to."""
        pc = self.engine.parallel_config
        if pc.pipeline_parallel_size == self.configured_pp:
            self.restore_partition = pc.pp_layer_partition

    def grow_due(self) -> bool:
        """Whether an automatic grow should be tried now."""
        return self.missing_stages > 0 and time.monotonic() >= self._next_grow_at

    def postpone_grow(self) -> None:
        """The next automatic grow waits VLLM_PP_REGROW_INTERVAL_S."""
        self._next_grow_at = time.monotonic() + regrow_interval_s()

    def after_resize(self, resize: PipelineResizeEvent | None, keep_blocks: bool = False) -> None:
        """What follows the pipeline's size on the engine's side, once the stages re-formed:
        the block manager, micro-batches in flight, the adapters, the rebalance window; then
        `resize` is completed and recorded. `keep_blocks`: the groups kept their blocks (the
        block manager is already sized)."""
        engine = self.engine
        if keep_blocks:
            num_gpu_blocks = engine.scheduler.block_manager.num_total_gpu_blocks
        else:
            num_gpu_blocks = self.reshaper.resize_block_manager()
        engine.reconfigure_pipelining()
        engine.loras.resync()  # stages that loaded new layers install the adapters again
        self.reshaper.restart_window()
        if resize is not None:
            resize.new_split = self.reshaper.current_split()
            resize.num_gpu_blocks = num_gpu_blocks
            self.events.append(resize)
