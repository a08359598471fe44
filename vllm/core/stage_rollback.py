"""The scheduler's side of a stage-local KV rebuild: after failed stages were replaced, keep
each request's committed KV where every survivor still holds it, and say which requests must
be recomputed in full instead. Imports no torch.

The KV of a sequence's first `num_computed_tokens` tokens is valid on every surviving stage:
that count only advances when a step's output comes back (`Scheduler.finish_in_flight`), and a
survivor runs every step it was sent, in order -- the block operations (swap in / out, copy)
even of steps after one it failed (`Worker.execute_model`), while those of a step whose
submission failed reach no rank and are applied before the replay
(`BatchQueue.unsent_block_ops`). So every survivor holds the blocks the scheduler's tables
name. The steps in flight at the failure are lost: their groups are rolled back to their
committed state, keeping their blocks. Recomputed in full instead:
- a prompt that classic scheduling runs whole (or several diverged samples, never chunked):
  it is rescheduled as a new prompt anyway (it has at most a cached prefix computed);
- a swapped group that cannot come back now: the replaced stage's copy of its blocks is
  garbage and only a replay brings it back, so it is swapped in with the replay or recomputed.
Free blocks of the prefix cache are garbage on the new stage: dropped from the cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.core.block_manager import AllocStatus
from vllm.sequence import SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from vllm.core.scheduler import Scheduler

logger = logging.getLogger("vllm.core.stage_rollback")


@dataclass
class RollbackPlan:
    """What `roll_back_for_replay` decided, group by group."""

    # Running groups (swapped-in ones included) whose committed tokens are replayed.
    replayed: list[SequenceGroup] = field(default_factory=list)
    # Swapped groups brought back with the replay: {cpu block: gpu block}.
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    swapped_in: list[str] = field(default_factory=list)
    # Request id -> why it is recomputed in full (re-queued as waiting).
    recomputed: dict[str, str] = field(default_factory=dict)


def roll_back_for_replay(sched: Scheduler) -> RollbackPlan:
    """Roll the groups in flight back to their committed state without freeing their blocks,
    and decide per unfinished group: replay (kept) or full recompute (re-queued)."""
    sched.drop_steps_in_flight()  # the replaced stages hold nothing; all re-learn in full
    plan = RollbackPlan()
    bm = sched.block_manager
    chunked = sched.scheduler_config.enable_chunked_prefill
    recompute: list[SequenceGroup] = []
    kept = []
    for group in sched.running:
        if group.is_finished():
            continue
        why = _why_recompute(group, chunked)
        if why is None:
            kept.append(group)
        else:
            plan.recomputed[group.request_id] = why
            recompute.append(group)
    sched.running.clear()
    sched.running.extend(kept)
    still_swapped = list(sched.swapped)
    sched.swapped.clear()
    for group in still_swapped:
        if group.is_finished():
            continue
        why = _why_recompute(group, chunked) or _swap_in_refusal(sched, group)
        if why is not None:
            plan.recomputed[group.request_id] = why
            recompute.append(group)
            continue
        plan.blocks_to_swap_in.update(bm.swap_in(group))
        for seq in group.get_seqs(status=SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.RUNNING
        sched.running.append(group)
        plan.swapped_in.append(group.request_id)
    sched.requeue(recompute)
    # After the frees above: blocks they parked in the prefix cache are garbage too.
    bm.drop_free_cached_blocks()
    plan.replayed = list(sched.running)
    return plan


def _why_recompute(group: SequenceGroup, chunked: bool) -> str | None:
    if group.is_prefill() and (not chunked or group.num_unfinished_seqs() > 1):
        return "its prompt runs whole when scheduled again"
    return None


def _swap_in_refusal(sched: Scheduler, group: SequenceGroup) -> str | None:
    """Why the swapped `group` cannot come back with the replay (None: it can)."""
    if sched.block_manager.can_swap_in(group) != AllocStatus.OK:
        return "swapped, and no room to swap it in with the replay"
    num_seqs = sched.num_running_seqs() + group.get_max_num_running_seqs()
    if num_seqs > sched.budget.max_num_seqs:
        return "swapped, and max_num_seqs leaves no room to swap it in with the replay"
    if not sched.lora_admission.allows(group, sched.running):
        return "swapped, and max_loras leaves no room to swap it in with the replay"
    return None
