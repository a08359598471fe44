"""The engine's side of a shrink that rebuilds only the lost layers (PP N -> N-1 with the
boundary caches on): after `executor.remove_stages(..., merge=True)` one neighbour holds the
lost stage's layers besides its own (`vllm.worker.stage_merge`) and every other stage kept
its range and KV. Here the engine keeps its block count when that neighbour can hold it with
its new layers, or shrinks the pool to what it can hold when no block in use is above that
(else `NotLocal`: nothing changed yet, the caller recomputes in full); applies the block
operations of steps no rank got and brings swapped groups back first (the neighbour has no
host copy of the gained layers, and its host tensors may be re-made); grows the neighbour's
cache; and replays the committed tokens of the kept groups through the gained layers only,
in chunks of `max_num_batched_tokens` (`vllm.engine.stage_replay`). Nothing is sent between
stages. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.core.stage_rollback import RollbackPlan, requeue_after_replay
from vllm.engine.stage_replay import replay_steps, replay_tokens
from vllm.step_delta import BlockOps, ReplayRequest

if TYPE_CHECKING:
    from vllm.engine.llm_engine import LLMEngine


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


def refusal(engine: LLMEngine, plan: RollbackPlan | None, num_lost_stages: int) -> str | None:
    """Why a shrink recomputes every request instead of rebuilding the lost layers on the
    neighbour that takes them (None: it can try)."""
    if plan is None:
        return "stage-local recovery is off (no boundary caches)"
    if num_lost_stages != 1:
        return f"{num_lost_stages} stages were lost at once"
    if engine.lora_config is not None:
        return "LoRA is enabled (the gained layers would need their adapters first)"
    return None


def rebuild_merged_stage(
    engine: LLMEngine, plan: RollbackPlan, unsent: list[BlockOps]
) -> MergeRebuild:
    """Rebuild the KV of the layers the merged stage took over (see the module docstring);
    `unsent`: block operations of steps no rank got, applied first on every rank.
    Raises NotLocal, before any stage changed, when its cache cannot keep every group's
    blocks; any other error leaves the caller to recompute in full."""
    executor = engine.executor
    merged = executor.merged
    assert merged is not None, "remove_stages(merge=True) first"
    sched = engine.scheduler
    # The merged stage holds nothing for the gained layers of a swapped group, and one with
    # no room to come back with the replay would need a round of its own (as a replaced
    # stage's: `StageRecovery._rebuild_swapped_in_rounds`): recomputed instead, here rare.
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
    pc = engine.parallel_config
    # The block operations no rank got, then the swapped groups coming back, first, on every
    # rank: the merged stage's host tensors may be re-made below, and hold nothing for the
    # gained layers anyway (the replay writes them).
    if plan.blocks_to_swap_in or unsent:
        before = [*unsent, BlockOps(swap_in=plan.blocks_to_swap_in)]
        request = ReplayRequest([], kv_blocks_bound=sched.kv_blocks_bound(), before=before)
        executor.replay_gained_layers(request, pc.step_deadline_s(0))
    executor.grow_merged_cache(num_gpu, num_cpu)  # the engine's block counts from now on
    if shrinks:
        why = sched.shrink_kv_cache(num_gpu, num_cpu)
        assert why is None, why  # checked above; nothing was allocated since
    groups = [g for g in plan.replayed if not g.is_finished()]
    steps = replay_steps(groups, sched.block_manager, sched.budget.max_num_batched_tokens)
    for step in steps:
        num_tokens = sum(meta.token_chunk_size or 0 for meta in step)
        request = ReplayRequest(
            rebuild_stages=[merged.stage], groups=step, kv_blocks_bound=sched.kv_blocks_bound()
        )
        executor.replay_gained_layers(request, pc.step_deadline_s(num_tokens))
    executor.finish_merge()
    requeue_after_replay(sched, plan)
    return MergeRebuild(
        merged.stage, merged.lost_stage, merged.lost_layers, merged.layers,
        replay_tokens(steps), len(steps), len(groups), len(plan.swapped_in), num_gpu,
    )  # fmt: skip
