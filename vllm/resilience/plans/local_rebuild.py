"""Local rebuild: the failed stages were replaced in place, and only they get their KV back.

The steps in flight were lost, so their groups rolled back to their committed state keeping
their blocks (`vllm.core.stage_rollback`); the replaced stages re-prefill the committed tokens
in chunks (`vllm.resilience.replay`), from the token ids (first stage) or the previous stage's
boundary cache, while every other stage keeps its KV and swap copies. Swapped groups with no
room to come back at once are rebuilt one round each. Work: replayed tokens x stages rebuilt
(+ the requests the rollback could not keep, in full). Needs the stages' boundary caches
(`stage_recovery="local"`, PP > 1). A replay step that fails falls back to a full recompute
(`plans/full_recompute.py`). Imports no torch.
"""

from __future__ import annotations

import time

from vllm.core.stage_rollback import (
    RollbackPlan,
    end_swap_round,
    log_rollback,
    next_swap_round,
    requeue_after_replay,
)
from vllm.logger import init_logger
from vllm.resilience.engine_control import EngineControl
from vllm.resilience.events import LOCAL, FaultEvent
from vllm.resilience.plans import full_recompute
from vllm.resilience.replay import replay_steps, replay_tokens, run_replay, tokens_in_full
from vllm.step_records import BlockOps

logger = init_logger("vllm.resilience.plans.local_rebuild")


def rebuild(
    engine: EngineControl,
    plan: RollbackPlan,
    stages: list[int],
    event: FaultEvent,
    committed_at_fault: dict[int, int],
    unsent: list[BlockOps],
) -> None:
    """Replay the kept groups' committed tokens through the replaced `stages` and fill in
    `event`'s work figures. `committed_at_fault`: each sequence's tokens with KV at the
    failure; `unsent`: block operations of steps no rank got, applied first."""
    started = time.perf_counter()
    sched = engine.scheduler
    pp = engine.parallel_config.pipeline_parallel_size
    groups = [g for g in plan.replayed if not g.is_finished()]
    steps = replay_steps(groups, sched.block_manager, sched.budget.max_num_batched_tokens)
    logger.info(
        "Stage-local rebuild of stage(s) %s: %d requests, %d tokens in %d replay step(s) "
        "(%d swapped requests swapped in with it, block operations of %d unsent step(s) "
        "applied first); %d swapped requests rebuilt in rounds; %d requests recomputed in "
        "full",
        stages, len(groups), replay_tokens(steps), len(steps), len(plan.swapped_in),
        len(unsent), len(plan.swap_rounds), len(plan.recomputed),
    )  # fmt: skip
    try:
        before = [*unsent, BlockOps(swap_in=plan.blocks_to_swap_in)]
        replayed = run_replay(
            engine.executor.require_stage_control("rebuild a stage").replay,
            engine.parallel_config.step_deadline_s,
            stages,
            steps,
            sched.kv_blocks_bound(),
            before,
        )
        replayed += _rebuild_swapped_in_rounds(engine, plan, stages)
        requeue_after_replay(sched, plan)
    except Exception as exc:
        logger.error(
            "Stage-local rebuild failed (%s: %s); recomputing every request in full",
            type(exc).__name__,
            exc,
        )
        full_recompute.fall_back(event, sched, committed_at_fault, pp)
        event.replay_s = time.perf_counter() - started
        return
    log_rollback(plan)
    requeued = [g for g in sched.waiting if g.request_id in plan.recomputed]
    in_full = tokens_in_full(requeued, committed_at_fault)
    event.stage_recovery = LOCAL
    event.rebuilt_stages = stages
    event.replayed_tokens = replayed
    event.swap_rounds_requests = len(plan.swap_rounds)
    event.recomputed_requests = dict(plan.recomputed)
    event.recomputed_tokens = replayed + in_full
    event.recomputed_token_stages = replayed * len(stages) + in_full * pp
    event.replay_s = time.perf_counter() - started


def _rebuild_swapped_in_rounds(engine: EngineControl, plan: RollbackPlan, stages: list[int]) -> int:
    """Swapped groups with no room to come back now, one round each: swapped in (running
    groups lending their blocks if needed), their committed tokens replayed on the replaced
    `stages`, swapped out again (the replaced stage's host copy of them was garbage). One
    that cannot get the blocks even so is recomputed in full. Returns the tokens replayed."""
    sched = engine.scheduler
    bm = sched.block_manager
    max_tokens = sched.budget.max_num_batched_tokens
    replayed = 0
    for group in plan.swap_rounds:
        if group.is_finished():
            continue
        swap_round = next_swap_round(sched, group, plan.replayed)
        if swap_round is None:
            plan.recomputed[group.request_id] = (
                "swapped, and no room to swap it in for the replay even with running "
                "requests swapped out meanwhile"
            )
            sched.requeue([group])
            continue
        steps = replay_steps([group], bm, max_tokens) or [[]]
        after = end_swap_round(sched, swap_round)
        # Every block the round hands out (the lent groups' new ones too) is below it.
        sched.refresh_kv_blocks_bound()
        replayed += run_replay(
            engine.executor.require_stage_control("rebuild a stage").replay,
            engine.parallel_config.step_deadline_s,
            stages,
            steps,
            sched.kv_blocks_bound(),
            swap_round.before,
            after,
        )
    return replayed
