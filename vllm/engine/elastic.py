"""A pipeline that loses a stage it cannot replace and gets it back: PP N -> N-1 -> N while the
engine serves.

**Shrink.** When replacing a failed stage fails (`StageRecovery`: the new process cannot be
started, dies at start-up, or the restart deadline passes) and another stage is left, the
failed stage's ranks leave the pipeline (`executor.remove_stages`): the survivors are
renumbered in stage order and re-form the process groups at the smaller size. Then, two ways:
- **local** (`stage_recovery="shrink (local)"`: the stages keep boundary caches and the
  recovery rolled the groups back to their committed state, one stage lost, no LoRA): ONE
  neighbour takes the lost stage's layers (the previous stage; for the first stage, the next
  one), every other stage keeps its range, KV and swap copies, and only the gained layers'
  KV is replayed, on that neighbour alone, from its own boundary rows or the token ids
  (`vllm.engine.merge_rebuild`). Work: the committed tokens x one old stage's layers.
- **full** (`stage_recovery="shrink"`): an even split of the layers (each survivor loads
  only the layers it gains), caches re-sized at the new minimum, every request recomputed
  with the tokens it has (`Scheduler.requeue_all`). Also the fallback, logged with the
  reason, when the neighbour cannot hold the engine's blocks in use with its new layers, or
  the replay fails.
What depends on the pipeline's size follows (micro-batches in flight, scheduling ahead,
boundary caches: all read the parallel config's `pipeline_parallel_size`). It is the failure's
recovery: a fault event. The automatic or on-demand re-split (`vllm.engine.reshape`) can even
the merged split out later.

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
from vllm.core.stage_rollback import RollbackPlan, log_rollback
from vllm.distributed.pipeline_resize import stages_of
from vllm.engine.merge_rebuild import MergeRebuild, NotLocal, rebuild_merged_stage, refusal
from vllm.executor.base import ExecutorBase
from vllm.executor.stage_supervisor import FaultEvent, StageFailedError
from vllm.logger import init_logger
from vllm.step_delta import BlockOps

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


def can_resize_pipeline(executor: ExecutorBase) -> bool:
    """Whether `executor` can take stages out of its pipeline and back (mp, ray)."""
    return executor.stage_control is not None


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

    def shrink(
        self,
        error: StageFailedError,
        event: FaultEvent,
        why: str,
        plan: RollbackPlan | None = None,
        committed_at_fault: dict[int, int] | None = None,
        unsent: list[BlockOps] | None = None,
    ) -> None:
        """The stages of `error` could not be replaced (`why`): the pipeline goes on without
        them. Called by the recovery with nothing in flight; `plan`: how it rolled the groups
        back for a stage-local rebuild (None: it did not), `committed_at_fault`: each
        sequence's tokens with KV at the failure, `unsent`: block operations of steps no rank
        got (applied before the local rebuild). Raises when re-forming fails (the caller
        ends the engine)."""
        engine = self.engine
        pc = engine.parallel_config
        old_pp = pc.pipeline_parallel_size
        old_split = engine.reshaper.current_split()
        stages = stages_of(error.ranks, pc.tensor_parallel_size)
        if old_pp == self.configured_pp:
            self._restore_partition = pc.pp_layer_partition
        started = time.monotonic()
        rebuilt: MergeRebuild | None = None
        not_local = refusal(engine, plan, len(stages))
        requeued: list[str] = []
        if not_local is None:
            assert plan is not None
            control = engine.executor.require_stage_control("remove a stage")
            control.remove_stages(error.ranks, merge=True)
            try:
                rebuilt = rebuild_merged_stage(engine, plan, unsent or [])
            except NotLocal as exc:
                not_local = str(exc)
            except Exception as exc:
                not_local = f"rebuilding the lost layers failed ({type(exc).__name__}: {exc})"
                logger.error("Shrinking the pipeline: %s", not_local)
            if rebuilt is None:
                requeued = engine.scheduler.requeue_all()
                control.split_evenly()
        else:
            # The layers move between stages: no stage's KV is valid afterwards.
            requeued = engine.scheduler.requeue_all()
            engine.executor.require_stage_control("remove a stage").remove_stages(error.ranks)
        if not_local is not None and plan is not None:
            logger.warning(
                "Shrinking the pipeline: every request is recomputed in full (%s)", not_local
            )
        seconds = time.monotonic() - started
        pc = engine.parallel_config  # the pipeline as it runs now (the executor's shape)
        resize = PipelineResizeEvent(
            "shrink", old_pp, pc.pipeline_parallel_size, old_split, [], seconds
        )
        self._after_resize(resize, keep_blocks=rebuilt is not None)
        event.recovery_s = seconds
        event.extra.update(
            pipeline_parallel_size=pc.pipeline_parallel_size, layer_split=resize.new_split
        )
        if rebuilt is not None:
            assert plan is not None
            resize.recomputed_requests = len(plan.recomputed)
            self._account_local(event, plan, rebuilt, committed_at_fault or {}, old_pp)
        else:
            # Requests re-queued by the recovery's rollback are in the waiting queue already.
            resize.recomputed_requests = max(len(requeued), event.requeued_requests)
            tokens = event.extra.get("full_path_token_stages", 0) // old_pp
            event.extra.update(
                stage_recovery="shrink",
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

    def _account_local(
        self,
        event: FaultEvent,
        plan: RollbackPlan,
        rebuilt: MergeRebuild,
        committed_at_fault: dict[int, int],
        old_pp: int,
    ) -> None:
        """The fault's figures and log line after the lost layers were rebuilt locally."""
        log_rollback(plan)
        # Groups re-queued by the rollback re-prefill every token they had KV for through
        # every layer (a prompt that was in flight had none: it computes nothing again).
        requeued = [g for g in self.engine.scheduler.waiting if g.request_id in plan.recomputed]
        in_full = sum(
            committed_at_fault.get(seq.seq_id, 0)
            for group in requeued
            for seq in group.get_unfinished_seqs()
        )
        replayed = rebuilt.replayed_tokens
        event.extra.update(
            stage_recovery="shrink (local)",
            merged_into=rebuilt.stage,
            replayed_tokens=replayed,
            swapped_in_requests=rebuilt.swapped_in,
            recomputed_requests=dict(plan.recomputed),
            recomputed_tokens=replayed + in_full,
            # In stage-equivalents of the old pipeline, as `full_path_token_stages` (tokens x
            # old PP): a replayed token ran the lost stage's layers once (1 stage); a token
            # recomputed in full runs every layer (old PP stages).
            recomputed_token_stages=replayed + in_full * old_pp,
        )
        logger.info(
            "Stage %d's layers [%d, %d) merged into stage %d (now layers [%d, %d)): %d tokens "
            "of %d requests replayed through those layers only, on that stage, in %d replay "
            "step(s) (%d swapped requests swapped in with it); every other stage kept its "
            "layers and KV; %d requests recomputed in full",
            rebuilt.lost_stage, *rebuilt.lost_layers, rebuilt.stage, *rebuilt.layers,
            replayed, rebuilt.requests, rebuilt.replay_steps, rebuilt.swapped_in,
            len(plan.recomputed),
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
            control = engine.executor.require_stage_control("add a stage")
            ranks = control.start_stages(missing, self._restore_partition)
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
            control.join_stages()
        except Exception as exc:
            logger.error(
                "Re-forming the pipeline at PP=%d failed (%s: %s); the new stage(s) leave again",
                self.configured_pp, type(exc).__name__, exc,
            )  # fmt: skip
            self._remove_again(ranks, exc)
            return False
        pc = engine.parallel_config  # the pipeline as it runs now (the executor's shape)
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
            engine.executor.require_stage_control("remove a stage").remove_stages(ranks)
        except StageFailedError as error:
            engine._fail(error, f"growing the pipeline failed ({cause}) and so did going back")
        self._after_resize(None)

    # -- shared --------------------------------------------------------------------------------

    def _after_resize(self, resize: PipelineResizeEvent | None, keep_blocks: bool = False) -> None:
        """What follows the pipeline's size on the engine's side, once the stages re-formed.
        `keep_blocks`: the groups kept their blocks (the block manager is already sized)."""
        engine = self.engine
        if keep_blocks:
            num_gpu_blocks = engine.scheduler.block_manager.num_total_gpu_blocks
        else:
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
