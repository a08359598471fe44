"""Shrink: a failed stage that cannot be replaced (the new process cannot be started, dies at
start-up, or the restart deadline passes) leaves the pipeline, PP N -> N-1, while the engine
serves (`executor.remove_stages`: the survivors are renumbered in stage order and re-form the
process groups at the smaller size). Then, two ways:

- **local** (`stage_recovery="shrink (local)"`: the stages keep boundary caches and the
  recovery rolled the groups back to their committed state, one stage lost, no LoRA): ONE
  neighbour merges the lost stage's layers into its own (the previous stage; for the first
  stage, the next one: `vllm.worker.stage_merge`), every other stage keeps its range, KV and
  swap copies. The engine keeps its block count when that neighbour can hold it with its new
  layers, or shrinks the pool to what it can hold when no block in use is above that (else
  `NotLocal`: nothing changed yet, the full way follows); applies the block operations of
  steps no rank got and brings swapped groups back first (the neighbour has no host copy of
  the gained layers, and its host tensors may be re-made); grows the neighbour's cache; and
  replays the committed tokens through the gained layers only (`vllm.resilience.replay`).
  Work: the committed tokens x one old stage's layers.
- **full** (`stage_recovery="shrink"`): an even split of the layers (each survivor loads only
  the layers it gains), caches re-sized at the new minimum, every request recomputed with the
  tokens it has (`Scheduler.requeue_all`). Also the fallback, logged with the reason.

What depends on the pipeline's size follows (`PipelineResizes.after_resize`). A reshape can
even the merged split out later; growing back is `plans/grow.py`. Imports no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm.core.stage_rollback import RollbackPlan, log_rollback, requeue_after_replay
from vllm.distributed.pipeline_resize import stages_of
from vllm.executor.base import ExecutorBase
from vllm.logger import init_logger
from vllm.resilience.engine_control import EngineControl
from vllm.resilience.errors import StageFailedError
from vllm.resilience.events import SHRINK, SHRINK_LOCAL, FaultEvent, PipelineResizeEvent
from vllm.resilience.replay import replay_steps, run_replay, tokens_in_full
from vllm.resilience.resizes import PipelineResizes, regrow_interval_s
from vllm.step_records import BlockOps

logger = init_logger("vllm.resilience.plans.shrink")


class NotLocal(Exception):
    """The lost layers cannot be rebuilt locally (the message says why); nothing changed."""


@dataclass
class MergeRebuild:
    """What the local rebuild of a merged stage did."""

    stage: int  # the stage that took the layers (its number in the smaller pipeline)
    lost_stage: int
    lost_layers: tuple[int, int]
    layers: tuple[int, int]
    replayed_tokens: int
    replay_steps: int
    requests: int
    swapped_in: int
    num_gpu_blocks: int


def can_resize_pipeline(executor: ExecutorBase) -> bool:
    """Whether `executor` can take stages out of its pipeline and back (mp, ray)."""
    return executor.stage_control is not None


def can_shrink(engine: EngineControl, error: StageFailedError) -> bool:
    """Whether the stages of `error` can leave instead of being replaced: a stage would be
    left and the backend can re-form a smaller pipeline."""
    pc = engine.parallel_config
    stages = stages_of(error.ranks, pc.tensor_parallel_size)
    return pc.pipeline_parallel_size > len(stages) and can_resize_pipeline(engine.executor)


def refusal(engine: EngineControl, plan: RollbackPlan | None, num_lost_stages: int) -> str | None:
    """Why a shrink recomputes every request instead of rebuilding the lost layers on the
    neighbour that takes them (None: it can try)."""
    if plan is None:
        return "stage-local recovery is off (no boundary caches)"
    if num_lost_stages != 1:
        return f"{num_lost_stages} stages were lost at once"
    if engine.lora_config is not None:
        return "LoRA is enabled (the gained layers would need their adapters first)"
    return None


def shrink(
    engine: EngineControl,
    resizes: PipelineResizes,
    error: StageFailedError,
    event: FaultEvent,
    why: str,
    plan: RollbackPlan | None,
    committed_at_fault: dict[int, int],
    unsent: list[BlockOps],
) -> None:
    """The stages of `error` could not be replaced (`why`): the pipeline goes on without
    them. Called by the coordinator with nothing in flight; `plan`: how it rolled the groups
    back for a stage-local rebuild (None: it did not), `committed_at_fault`: each sequence's
    tokens with KV at the failure, `unsent`: block operations of steps no rank got (applied
    before the local rebuild). Raises when re-forming fails (the caller ends the engine)."""
    pc = engine.parallel_config
    old_pp = pc.pipeline_parallel_size
    old_split = resizes.reshaper.current_split()
    stages = stages_of(error.ranks, pc.tensor_parallel_size)
    resizes.before_shrink()
    started = time.monotonic()
    rebuilt: MergeRebuild | None = None
    not_local = refusal(engine, plan, len(stages))
    requeued: list[str] = []
    if not_local is None:
        assert plan is not None
        control = engine.executor.require_stage_control("remove a stage")
        control.remove_stages(error.ranks, merge=True)
        try:
            rebuilt = _rebuild_merged_stage(engine, plan, unsent)
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
    resizes.after_resize(resize, keep_blocks=rebuilt is not None)
    event.recovery_s = seconds
    event.pipeline_parallel_size = pc.pipeline_parallel_size
    event.layer_split = resize.new_split
    if rebuilt is not None:
        assert plan is not None
        resize.recomputed_requests = len(plan.recomputed)
        _account_local(engine, event, plan, rebuilt, committed_at_fault, old_pp)
    else:
        # Requests re-queued by the recovery's rollback are in the waiting queue already.
        resize.recomputed_requests = max(len(requeued), event.requeued_requests)
        tokens = event.full_path_token_stages // old_pp
        event.stage_recovery = SHRINK
        event.recomputed_tokens = tokens
        event.recomputed_token_stages = tokens * pc.pipeline_parallel_size
    resizes.postpone_grow()
    logger.warning(
        "Pipeline shrunk from PP=%d to PP=%d after stage %s could not be replaced (%s); "
        "layers per stage %s -> %s in %.2f s; # GPU blocks: %d; %d requests will be "
        "recomputed with the tokens they have; growing back to PP=%d is tried every %g s",
        old_pp, pc.pipeline_parallel_size, ", ".join(map(str, stages)), why, old_split,
        resize.new_split, seconds, resize.num_gpu_blocks, resize.recomputed_requests,
        resizes.configured_pp, regrow_interval_s(),
    )  # fmt: skip


def _rebuild_merged_stage(
    engine: EngineControl, plan: RollbackPlan, unsent: list[BlockOps]
) -> MergeRebuild:
    """Rebuild the KV of the layers the merged stage took over (see the module docstring).
    Raises NotLocal, before any stage changed, when its cache cannot keep every group's
    blocks; any other error leaves the caller to recompute in full."""
    executor = engine.executor.require_stage_control("merge a lost stage's layers")
    merged = executor.merged
    assert merged is not None, "remove_stages(merge=True) first"
    sched = engine.scheduler
    # The merged stage holds nothing for the gained layers of a swapped group, and one with
    # no room to come back with the replay would need a round of its own (as a replaced
    # stage's: `plans/local_rebuild.py`): recomputed instead, here rare.
    for group in plan.swap_rounds:
        plan.recomputed[group.request_id] = "swapped, and no room to swap it in with the replay"
    sched.requeue(plan.swap_rounds)
    plan.swap_rounds = []
    cc = engine.cache_config
    assert cc.num_gpu_blocks is not None and cc.num_cpu_blocks is not None
    num_gpu = min(cc.num_gpu_blocks, merged.num_gpu_blocks)
    num_cpu = min(cc.num_cpu_blocks, merged.num_cpu_blocks)
    shrinks = (num_gpu, num_cpu) != (cc.num_gpu_blocks, cc.num_cpu_blocks)
    if shrinks:
        why = sched.block_manager.why_not_shrink(num_gpu, num_cpu)
        if why is not None:
            raise NotLocal(
                f"with its new layers stage {merged.stage} holds {merged.num_gpu_blocks} "
                f"device / {merged.num_cpu_blocks} host blocks, fewer than the engine's "
                f"{cc.num_gpu_blocks} / {cc.num_cpu_blocks}, and {why}"
            )
    send = executor.replay_gained_layers
    deadline = engine.parallel_config.step_deadline_s
    # The block operations no rank got, then the swapped groups coming back, first, on every
    # rank: the merged stage's host tensors may be re-made below, and hold nothing for the
    # gained layers anyway (the replay writes them).
    if plan.blocks_to_swap_in or unsent:
        before = [*unsent, BlockOps(swap_in=plan.blocks_to_swap_in)]
        run_replay(send, deadline, [], [], sched.kv_blocks_bound(), before)
    executor.grow_merged_cache(num_gpu, num_cpu)  # the engine's block counts from now on
    if shrinks:
        why = sched.shrink_kv_cache(num_gpu, num_cpu)
        assert why is None, why  # checked above; nothing was allocated since
    groups = [g for g in plan.replayed if not g.is_finished()]
    steps = replay_steps(groups, sched.block_manager, sched.budget.max_num_batched_tokens)
    replayed = run_replay(send, deadline, [merged.stage], steps, sched.kv_blocks_bound())
    executor.finish_merge()
    requeue_after_replay(sched, plan)
    return MergeRebuild(
        merged.stage, merged.lost_stage, merged.lost_layers, merged.layers,
        replayed, len(steps), len(groups), len(plan.swapped_in), num_gpu,
    )  # fmt: skip


def _account_local(
    engine: EngineControl,
    event: FaultEvent,
    plan: RollbackPlan,
    rebuilt: MergeRebuild,
    committed_at_fault: dict[int, int],
    old_pp: int,
) -> None:
    """The fault's figures and log line after the lost layers were rebuilt locally."""
    log_rollback(plan)
    # Groups re-queued by the rollback re-prefill every token they had KV for through every
    # layer.
    requeued = [g for g in engine.scheduler.waiting if g.request_id in plan.recomputed]
    in_full = tokens_in_full(requeued, committed_at_fault)
    replayed = rebuilt.replayed_tokens
    event.stage_recovery = SHRINK_LOCAL
    event.merged_into = rebuilt.stage
    event.replayed_tokens = replayed
    event.swapped_in_requests = rebuilt.swapped_in
    event.recomputed_requests = dict(plan.recomputed)
    event.recomputed_tokens = replayed + in_full
    # In stage-equivalents of the old pipeline, as `full_path_token_stages` (tokens x old PP):
    # a replayed token ran the lost stage's layers once (1 stage); a token recomputed in full
    # runs every layer (old PP stages).
    event.recomputed_token_stages = replayed + in_full * old_pp
    logger.info(
        "Stage %d's layers [%d, %d) merged into stage %d (now layers [%d, %d)): %d tokens "
        "of %d requests replayed through those layers only, on that stage, in %d replay "
        "step(s) (%d swapped requests swapped in with it); every other stage kept its "
        "layers and KV; %d requests recomputed in full",
        rebuilt.lost_stage, *rebuilt.lost_layers, rebuilt.stage, *rebuilt.layers,
        replayed, rebuilt.requests, rebuilt.replay_steps, rebuilt.swapped_in,
        len(plan.recomputed),
    )  # fmt: skip
