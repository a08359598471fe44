"""A pipeline that loses a stage it cannot replace and gets it back: PP N -> N-1 -> N while the
engine serves.

**Shrink.** When replacing a failed stage fails (`StageRecovery`: the new process cannot be
started, dies at start-up, or the restart deadline passes) and another stage is left, the
failed stage's ranks leave the pipeline (`executor.remove_stages`): the survivors are
renumbered in stage order, re-form the process groups at the smaller size, take an even split
of the layers (loading only the layers each gains) and re-size their KV caches. Every request
is recomputed with the tokens it has (`Scheduler.requeue_all`; the layers moved, so no stage's
KV is valid), the block manager takes the new minimum, and what depends on the pipeline's
size follows (micro-batches in flight, scheduling ahead, boundary caches: all read the
parallel config's `pipeline_parallel_size`). It is the failure's recovery: a fault event.

**Grow back.** While smaller than configured, the engine tries to get the missing stages back
between steps at most every VLLM_PP_REGROW_INTERVAL_S, or when asked
(`LLMEngine.grow_pipeline`): the pipeline is drained, the missing stages' processes are
started first (`executor.start_stages`; a failure logs one line and leaves everything as it
was), then the requests are re-queued and the groups re-formed at the full size with the
split in effect when the stage was lost (`executor.join_stages`).

Greedy and seeded outputs are unchanged through both: seeded draws are re-seeded from the
tokens generated (`sampling_metadata.sample_seed`), as after any recompute.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.pipeline_resize import stages_of
from vllm.executor.stage_supervisor import FaultEvent, StageFailedError
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.engine.llm_engine import LLMEngine

logger = init_logger("vllm.engine.elastic")


@dataclass
class PipelineResizeEvent:
    """One change of the pipeline's size: why, the stages and layers before and after."""

    reason: str  # "shrink" (a stage could not be replaced) or "grow"
    old_pp: int
    new_pp: int
    old_split: list[int]
    new_split: list[int]
    seconds: float = 0.0
    recomputed_requests: int = 0
    num_gpu_blocks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def can_resize_pipeline(executor: Any) -> bool:
    """Whether `executor` can take stages out of its pipeline and back (the mp backend)."""
    from vllm.executor.base import ExecutorBase

    remove = getattr(executor, "remove_stages", None)
    return remove is not None and getattr(remove, "__func__", remove) is not (
        ExecutorBase.remove_stages
    )


class ElasticPipeline:
    """Owns the engine's configured pipeline size, shrinks it after a stage that cannot be
    replaced and grows it back (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        pc = engine.parallel_config
        self.configured_pp = pc.pipeline_parallel_size
        # The split to go back to (the one in effect when the first stage was lost).
        self._restore_partition = pc.pp_layer_partition
        self._next_attempt = 0.0  # time.monotonic() before which no automatic grow starts
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
            "could not be replaced; growing back is tried every "
            f"{_regrow_interval_s():g} s"
        )

    def can_shrink(self, error: StageFailedError) -> bool:
        """Whether the stages of `error` can leave instead of being replaced: a stage would
        be left and the backend can re-form a smaller pipeline."""
        pc = self.engine.parallel_config
        stages = stages_of(error.ranks, pc.tensor_parallel_size)
        return pc.pipeline_parallel_size > len(stages) and can_resize_pipeline(self.engine.executor)

    # -- shrink --------------------------------------------------------------------------------

    def shrink(self, error: StageFailedError, event: FaultEvent, why: str) -> None:
        """The stages of `error` could not be replaced (`why`): the pipeline goes on without
        them. Called by the recovery with nothing in flight; raises when re-forming fails
        (the caller ends the engine)."""
        engine = self.engine
        pc = engine.parallel_config
        old_pp = pc.pipeline_parallel_size
        old_split = engine.reshaper.current_split()
        stages = stages_of(error.ranks, pc.tensor_parallel_size)
        if old_pp == self.configured_pp:
            self._restore_partition = pc.pp_layer_partition
        # The layers move between stages: no stage's KV is valid afterwards.
        requeued = engine.scheduler.requeue_all()
        seconds = engine.executor.remove_stages(error.ranks)
        resize = PipelineResizeEvent(
            "shrink", old_pp, pc.pipeline_parallel_size, old_split, [], seconds
        )
        self._after_resize(resize)
        # Requests re-queued by the recovery's rollback are in the waiting queue already.
        resize.recomputed_requests = max(len(requeued), event.requeued_requests)
        tokens = event.extra.get("full_path_token_stages", 0) // old_pp
        event.recovery_s = seconds
        event.extra.update(
            stage_recovery="shrink",
            pipeline_parallel_size=pc.pipeline_parallel_size,
            layer_split=resize.new_split,
            recomputed_tokens=tokens,
            recomputed_token_stages=tokens * pc.pipeline_parallel_size,
        )
        self._next_attempt = time.monotonic() + _regrow_interval_s()
        logger.warning(
            "Pipeline shrunk from PP=%d to PP=%d after stage %s could not be replaced (%s); "
            "layers per stage %s -> %s in %.2f s; # GPU blocks: %d; %d requests will be "
            "recomputed with the tokens they have; growing back to PP=%d is tried every %g s",
            old_pp, pc.pipeline_parallel_size, ", ".join(map(str, stages)), why, old_split,
            resize.new_split, seconds, resize.num_gpu_blocks, resize.recomputed_requests,
            self.configured_pp, _regrow_interval_s(),
        )  # fmt: skip

    # -- grow back -----------------------------------------------------------------------------

    def maybe_grow(self) -> None:
        """Between steps: while stages are missing, try to grow back at most every
        VLLM_PP_REGROW_INTERVAL_S."""
        if self.missing_stages > 0 and time.monotonic() >= self._next_attempt:
            self.grow()

    def grow(self) -> bool:
        """Start the missing stages and re-form the pipeline at its configured size with the
        split it had; returns whether it grew. A stage that cannot be started logs one line
        and changes nothing (the next automatic try waits VLLM_PP_REGROW_INTERVAL_S). Outputs
        collected while draining are returned by the engine's next step."""
        engine = self.engine
        if self.missing_stages <= 0 or not can_resize_pipeline(engine.executor):
            return False
        self._next_attempt = time.monotonic() + _regrow_interval_s()
        engine.reshaper.drain()
        missing = self.missing_stages  # a failure while draining may have shrunk it more
        pc = engine.parallel_config
        old_pp, old_split = pc.pipeline_parallel_size, engine.reshaper.current_split()
        started = time.monotonic()
        try:
            ranks = engine.executor.start_stages(missing, self._restore_partition)
        except Exception as exc:
            logger.warning(
                "Growing the pipeline back to PP=%d failed (%s: %s); going on at PP=%d, next "
                "try in %g s",
                self.configured_pp, type(exc).__name__, exc, old_pp, _regrow_interval_s(),
            )  # fmt: skip
            return False
        requeued = engine.scheduler.requeue_all()
        engine.batch_queue.reset()
        try:
            engine.executor.join_stages()
        except Exception as exc:
            logger.error(
                "Re-forming the pipeline at PP=%d failed (%s: %s); the new stage(s) leave again",
                self.configured_pp, type(exc).__name__, exc,
            )  # fmt: skip
            self._remove_again(ranks, exc)
            return False
        resize = PipelineResizeEvent(
            "grow", old_pp, pc.pipeline_parallel_size, old_split, [], 0.0, len(requeued)
        )
        self._after_resize(resize)
        resize.seconds = time.monotonic() - started
        logger.info(
            "Pipeline grown back from PP=%d to PP=%d: layers per stage %s -> %s in %.2f s; "
            "# GPU blocks: %d; %d requests will be recomputed with the tokens they have",
            old_pp, pc.pipeline_parallel_size, old_split, resize.new_split, resize.seconds,
            resize.num_gpu_blocks, resize.recomputed_requests,
        )  # fmt: skip
        return True

    def _remove_again(self, ranks: list[int], cause: Exception) -> None:
        """A grow failed half-way: back to the smaller pipeline, or the engine ends."""
        engine = self.engine
        engine.scheduler.requeue_all()
        engine.batch_queue.reset()
        try:
            engine.executor.remove_stages(ranks)
        except StageFailedError as error:
            engine._fail(error, f"growing the pipeline failed ({cause}) and so did going back")
        self._after_resize(None)

    # -- shared --------------------------------------------------------------------------------

    def _after_resize(self, resize: PipelineResizeEvent | None) -> None:
        """What follows the pipeline's size on the engine's side, once the stages re-formed."""
        engine = self.engine
        num_gpu_blocks = engine.reshaper.resize_block_manager()
        engine._configure_pipelining()
        engine.loras.resync()  # stages that loaded new layers install the adapters again
        engine.reshaper.restart_window()
        if resize is not None:
            resize.new_split = engine.reshaper.current_split()
            resize.num_gpu_blocks = num_gpu_blocks
            self.events.append(resize)


def _regrow_interval_s() -> float:
    return envs.get_float("VLLM_PP_REGROW_INTERVAL_S")
