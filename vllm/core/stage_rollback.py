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
- a prompt that classic scheduling runs whole (or several diverged samples, never chunked)
  runs again from the waiting queue; when it has committed KV (a cached prefix) that is
  replayed with the others first, so it stays in the prefix cache (`requeue_after`);
- a swapped group that max_loras keeps from being swapped in with the replay (the replaced
  stage's copy of its blocks is garbage and only a replay brings it back).
A swapped group with no room to come back now stays swapped and is rebuilt in a round of its
own (`next_swap_round`): swapped in (running groups already rebuilt lend their blocks,
swapped out meanwhile), replayed on the replaced stages, swapped out again.
Free blocks of the prefix cache are garbage on the new stage: dropped from the cache.

The rollback decides; the scheduler, seen as `RollbackQueues`, applies each decision to its
queues (set a group aside, swap one in for the replay, requeue), as it does a policy's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vllm.config import SchedulerConfig
from vllm.core.block_manager import AllocStatus, BlockSpaceManager
from vllm.core.budget import MicroBatchBudget
from vllm.core.lora_admission import LoRAAdmission
from vllm.sequence import SequenceGroup, SequenceStatus
from vllm.step_records import BlockOps

logger = logging.getLogger("vllm.core.stage_rollback")


class RollbackQueues(Protocol):
    """The scheduler as a rollback sees it: its queues read-only, the block manager (whose
    blocks a rollback swaps), and the operations that apply the rollback's decisions."""

    @property
    def running(self) -> Sequence[SequenceGroup]: ...

    @property
    def swapped(self) -> Sequence[SequenceGroup]: ...

    @property
    def scheduler_config(self) -> SchedulerConfig: ...

    @property
    def block_manager(self) -> BlockSpaceManager: ...

    @property
    def budget(self) -> MicroBatchBudget: ...

    @property
    def lora_admission(self) -> LoRAAdmission: ...

    def num_running_seqs(self) -> int: ...

    def drop_steps_in_flight(self) -> None: ...

    def set_aside(self, groups: Iterable[SequenceGroup]) -> None: ...

    def swap_in_for_replay(self, seq_group: SequenceGroup) -> dict[int, int]: ...

    def requeue(self, groups: list[SequenceGroup]) -> None: ...


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
    # Swapped groups with no room to come back (blocks or max_num_seqs): they stay swapped and
    # are rebuilt in rounds that swap some in, replay them and swap them out again.
    swap_rounds: list[SequenceGroup] = field(default_factory=list)
    # Request id -> why it runs again from the waiting queue (its prompt runs whole) although
    # it has committed KV (a cached prefix): replayed with the others, then re-queued, so
    # that KV stays in the prefix cache, valid on every stage (`requeue_after_replay`).
    requeue_after: dict[str, str] = field(default_factory=dict)


def roll_back_for_replay(sched: RollbackQueues) -> RollbackPlan:
    """Roll the groups in flight back to their committed state without freeing their blocks,
    and decide per unfinished group: replay (kept) or full recompute (re-queued)."""
    sched.drop_steps_in_flight()  # the replaced stages hold nothing; all re-learn in full
    plan = RollbackPlan()
    bm = sched.block_manager
    chunked = sched.scheduler_config.enable_chunked_prefill
    recompute: list[SequenceGroup] = []
    # Finished groups leave the queues; recomputed ones too, their blocks freed only once
    # every group is decided (the swapped groups' room is counted without those frees).
    leave: list[SequenceGroup] = []
    for group in sched.running:
        if group.is_finished():
            leave.append(group)
            continue
        why = _why_recompute(group, chunked)
        if why is None:
            continue
        if any(seq.data.get_num_computed_tokens() for seq in group.get_unfinished_seqs()):
            plan.requeue_after[group.request_id] = why
        else:
            plan.recomputed[group.request_id] = why
            recompute.append(group)
            leave.append(group)
    sched.set_aside(leave)
    for group in list(sched.swapped):
        if group.is_finished():
            sched.set_aside([group])
            continue
        why = _why_recompute(group, chunked) or _lora_refusal(sched, group)
        if why is not None:
            plan.recomputed[group.request_id] = why
            recompute.append(group)
            sched.set_aside([group])
            continue
        if not _room_to_swap_in(sched, group):
            plan.swap_rounds.append(group)  # stays swapped
            continue
        plan.blocks_to_swap_in.update(sched.swap_in_for_replay(group))
        plan.swapped_in.append(group.request_id)
    sched.requeue(recompute)
    # After the frees above: blocks they parked in the prefix cache are garbage too.
    bm.drop_free_cached_blocks()
    plan.replayed = list(sched.running)
    return plan


def requeue_after_replay(sched: RollbackQueues, plan: RollbackPlan) -> list[SequenceGroup]:
    """After the replay: the groups of `plan.requeue_after` wait again (their blocks freed,
    their replayed prefix left in the prefix cache); returns them."""
    groups = [g for g in sched.running if g.request_id in plan.requeue_after]
    sched.requeue(groups)
    return groups


def log_rollback(plan: RollbackPlan) -> None:
    """One warning per request that did not simply keep its KV."""
    for request_id, why in plan.recomputed.items():
        logger.warning("Request %s: recomputed in full (%s)", request_id, why)
    for request_id, why in plan.requeue_after.items():
        logger.warning(
            "Request %s: runs again from the waiting queue (%s); the KV it had was rebuilt "
            "and stays in the prefix cache",
            request_id,
            why,
        )


def _why_recompute(group: SequenceGroup, chunked: bool) -> str | None:
    if group.is_prefill() and (not chunked or group.num_unfinished_seqs() > 1):
        return "its prompt runs whole when scheduled again"
    return None


def _room_to_swap_in(sched: RollbackQueues, group: SequenceGroup) -> bool:
    """Whether the swapped `group` can come back now, with the replay."""
    if sched.block_manager.can_swap_in(group) != AllocStatus.OK:
        return False
    num_seqs = sched.num_running_seqs() + group.get_max_num_running_seqs()
    return num_seqs <= sched.budget.max_num_seqs


def _lora_refusal(sched: RollbackQueues, group: SequenceGroup) -> str | None:
    if not sched.lora_admission.allows(group, sched.running):
        return "swapped, and max_loras leaves no room to swap it in with the replay"
    return None


@dataclass
class SwapRound:
    """One swapped group rebuilt by itself: swapped in (after `lent` running groups were
    swapped out to make room, when the free blocks do not hold it), replayed, swapped out
    again; then the lent groups come back."""

    group: SequenceGroup
    lent: list[SequenceGroup]
    before: list[BlockOps]  # the block operations that bring it in


def next_swap_round(
    sched: RollbackQueues, group: SequenceGroup, lenders: list[SequenceGroup]
) -> SwapRound | None:
    """Swap the swapped `group` in for its replay. When the free device blocks do not hold
    it, running groups of `lenders` (already rebuilt; the last ones first) whose blocks are
    their own and fit the host are swapped out first. None (nothing changed) when even
    that leaves no room. The group's sequences are RUNNING until `end_swap_round`."""
    bm = sched.block_manager
    needed = bm.num_swapped_blocks(group)
    free = bm.get_num_free_gpu_blocks()
    host_room = bm.get_num_free_cpu_blocks()
    lent: list[SequenceGroup] = []
    for lender in reversed(lenders):
        if needed <= free:
            break
        blocks = bm.exclusive_blocks(lender)
        if lender.is_finished() or blocks is None or blocks > host_room:
            continue
        lent.append(lender)
        free += blocks
        host_room -= blocks
    if needed > free:
        return None
    before: list[BlockOps] = []
    if lent:
        lend_out: dict[int, int] = {}
        for lender in lent:
            lend_out.update(bm.swap_out(lender))
            _set_status(lender, SequenceStatus.RUNNING, SequenceStatus.SWAPPED)
        before.append(BlockOps(swap_out=lend_out))
    before.append(BlockOps(swap_in=bm.swap_in(group)))
    _set_status(group, SequenceStatus.SWAPPED, SequenceStatus.RUNNING)
    return SwapRound(group, lent, before)


def end_swap_round(sched: RollbackQueues, swap_round: SwapRound) -> list[BlockOps]:
    """The round's group goes back to the host and the lent groups come back (to blocks of
    their own again); the block operations that do it, in order."""
    bm = sched.block_manager
    group_out = bm.swap_out(swap_round.group)
    _set_status(swap_round.group, SequenceStatus.RUNNING, SequenceStatus.SWAPPED)
    lent_in: dict[int, int] = {}
    for lender in swap_round.lent:
        lent_in.update(bm.swap_in(lender))
        _set_status(lender, SequenceStatus.SWAPPED, SequenceStatus.RUNNING)
    return [BlockOps(swap_out=group_out), BlockOps(swap_in=lent_in)]


def _set_status(group: SequenceGroup, old: SequenceStatus, new: SequenceStatus) -> None:
    for seq in group.get_seqs(status=old):
        seq.status = new
