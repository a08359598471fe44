"""The scheduler's chunked-prefill policy, vLLM 0.5's (`enable_chunked_prefill`).

A step takes the running decodes first, then prefill chunks up to the token budget, so a long
prompt is prefilled over several steps next to the decodes (between two chunks its group is in
flight like a decode: chunks reach the cache in order). With pipeline parallelism the
micro-batches are balanced by tokens (`MicroBatchBudget.token_budget`).

`Scheduler.schedule` calls `ChunkedPolicy.schedule`; the queues, admission, swap-in,
preemption and scheduling ahead are the scheduler's (`vllm.core.scheduler`), which the policy
sees as `PolicyQueues`: it decides, the scheduler applies. Imports no torch.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from vllm.core.budget import over_cap
from vllm.core.chunk_sizer import ChunkSizer
from vllm.core.partial_prefills import PartialPrefillLimits, StepPrefills
from vllm.core.policy_api import PolicyQueues, SchedulerOutputs
from vllm.sequence import SequenceGroup, SequenceStatus

# The scheduler's logger: its warnings read the same whichever policy runs.
logger = logging.getLogger("vllm.core.scheduler")


@dataclass
class _Step:
    """One step being filled: its limits, what it took so far, and the running groups not
    in flight sorted by phase (decoding or prefilling, FCFS)."""

    out: SchedulerOutputs
    budget: int  # tokens
    decode_room: int  # tokens the decodes may take
    seq_cap: int  # sequences
    step_no: int
    # The partial prefills sharing the step's budget (set once `running` is sorted).
    partial: StepPrefills | None = None
    used: int = 0  # tokens taken
    batch_seqs: int = 0  # sequences taken by decodes
    decodes: collections.deque[SequenceGroup] = field(default_factory=collections.deque)
    prefills: collections.deque[SequenceGroup] = field(default_factory=collections.deque)
    # In flight, and allowed to run their next decode now (scheduling ahead).
    ahead: list[SequenceGroup] = field(default_factory=list)
    # In flight with a prefill chunk, and allowed to send their next chunk behind it
    # (chunked pipelining, `Scheduler.can_pipeline_chunk`).
    chunks_behind: list[SequenceGroup] = field(default_factory=list)
    scheduled_decodes: list[SequenceGroup] = field(default_factory=list)
    scheduled_prefills: list[SequenceGroup] = field(default_factory=list)

    def prefill_room(self) -> int:
        """The tokens the next prefill chunk may take: what is left of the budget, at most
        one partial prefill's share of it."""
        room = self.budget - self.used
        if self.partial is None:
            return room
        return min(room, self.partial.slot(self.budget))

    def take(self, seq_group: SequenceGroup, tokens: int, prefill: bool) -> None:
        (self.scheduled_prefills if prefill else self.scheduled_decodes).append(seq_group)
        self.out.token_chunk_sizes[seq_group.request_id] = tokens
        self.used += tokens


class ChunkedPolicy:
    """Decodes first, then prefill chunks of running groups, swapped groups and new prompts,
    within one token budget per step; a decode that needs a block preempts the
    latest-arriving group not scheduled yet. With `partial` limits of N > 1 the prefills
    share the step's budget and a long prompt may be passed over for shorter ones
    (`vllm.core.partial_prefills`)."""

    def __init__(
        self,
        queues: PolicyQueues,
        prefill_token_cap: int = 0,
        sizer: ChunkSizer | None = None,
        partial: PartialPrefillLimits | None = None,
    ) -> None:
        self.sched = queues
        self.partial = partial or PartialPrefillLimits()
        # Sizes one prompt's chunk to an even step cost (None: the whole room, vLLM's way).
        self.sizer = sizer
        # Tokens one prompt may take in a step (the `long_prefill_token_threshold` the user set,
        # `SchedulerConfig.prefill_token_cap`; a huge number when unset). Several diverged
        # sequences are never chunked: they are checked against the step's budget only.
        self._cap = prefill_token_cap if prefill_token_cap > 0 else 1 << 62

    def schedule(self, out: SchedulerOutputs, seq_cap: int, step_no: int) -> None:
        """Fill `out` with one step, at most `seq_cap` decoding sequences (the first group
        always fits); `step_no` is the step it will be submitted as."""
        budget, decode_budget = self._token_budget()
        step = _Step(out, budget, min(budget, decode_budget), seq_cap, step_no)
        self._sort_running(step)
        step.partial = self._partial_prefills(step)
        self._schedule_decodes(step)
        self._schedule_running_prefills(step)
        if out.num_preempted == 0 and self.sched.swapped:
            self._swap_in(step)
        # New prompts only when nothing waits to be swapped back in (it would starve) and
        # nothing was just preempted for lack of blocks.
        if out.num_preempted == 0 and not self.sched.swapped:
            self._admit_prompts(step)
        out.scheduled_seq_groups = step.scheduled_prefills + step.scheduled_decodes
        out.prompt_run = bool(step.scheduled_prefills)
        out.num_batched_tokens = step.used

    def _token_budget(self) -> tuple[int, int]:
        """(this micro-batch's token budget, the most of it decodes may take), from the decode
        and prefill work waiting (see `MicroBatchBudget.token_budget`)."""
        sched = self.sched
        if sched.budget.cohorts == 1:
            return sched.budget.token_budget(0, 0)
        decode_tokens = 0
        prefill_tokens = 0
        for group in sched.running:
            for seq in group.get_seqs(status=SequenceStatus.RUNNING):
                if seq.is_prefill():
                    prefill_tokens += seq.get_num_new_tokens()
                else:
                    decode_tokens += 1
        # Chunks in flight stay counted: the round's prefill work is the same whichever of
        # its micro-batches carries each chunk (not counting them would halve the chunks of
        # a prompt's tail, step after step).
        for group in sched.waiting:
            prefill_tokens += sum(s.get_len() for s in group.get_seqs(SequenceStatus.WAITING))
        return sched.budget.token_budget(decode_tokens, prefill_tokens)

    def _sort_running(self, step: _Step) -> None:
        """Order `running` by phase, each FCFS: groups in flight (or finished), then decodes,
        then prefills; sort the decodes and prefills into the step's queues (the groups stay
        in `running` unless the scheduler preempts them)."""
        sched = self.sched
        sched.sort_running(lambda g: (_phase(g), g.arrival_time))
        for seq_group in sched.running:
            phase = _phase(seq_group)
            if phase == 0:
                if seq_group.is_finished():
                    continue
                if sched.can_go_ahead(seq_group, step.step_no):
                    step.ahead.append(seq_group)
                elif seq_group.is_in_flight() and sched.can_pipeline_chunk(seq_group):
                    step.chunks_behind.append(seq_group)
            else:
                (step.prefills if phase == 2 else step.decodes).append(seq_group)

    def _partial_prefills(self, step: _Step) -> StepPrefills:
        """This step's partial prefills: the running prefills (a long one in progress counts
        against `max_long_partial_prefills` even while its chunks are in flight), those that
        may take a chunk now, and the waiting prompts (vLLM's `PartialPrefillMetadata`)."""
        if not self.partial.enabled:
            return StepPrefills(self.partial, 1, 0)  # one share: the whole budget
        running = (
            _tokens_left(g) for g in self.sched.running if g.is_prefill() and not g.is_finished()
        )
        schedulable = (_tokens_left(g) for g in [*step.prefills, *step.chunks_behind])
        waiting = (_waiting_tokens_left(g) for g in self.sched.waiting)
        return self.partial.for_step(running, schedulable, waiting)

    def _schedule_decodes(self, step: _Step) -> None:
        """The running decodes (preempting later groups for blocks), then those in flight
        that may go ahead (never preempting), within the decode room and the sequence cap."""
        sched = self.sched
        while step.decodes:
            seq_group = step.decodes.popleft()
            group_seqs = seq_group.num_seqs(status=SequenceStatus.RUNNING)
            if not self._decode_fits(step, group_seqs):
                continue
            if sched.grow_or_preempt(
                seq_group, step.out, lambda: _pop_victim(step.decodes, step.prefills)
            ):
                step.take(seq_group, group_seqs, prefill=False)
                step.batch_seqs += group_seqs
        for seq_group in step.ahead:
            group_seqs = seq_group.num_seqs(status=SequenceStatus.RUNNING)
            if self._decode_fits(step, group_seqs) and sched.try_schedule_ahead(
                seq_group, step.out
            ):
                step.take(seq_group, group_seqs, prefill=False)
                step.batch_seqs += group_seqs

    @staticmethod
    def _decode_fits(step: _Step, group_seqs: int) -> bool:
        # The first group of a batch always fits: the room is a share of the decodes known,
        # and a lone group of several samples (one token each) would never fit it.
        room = step.used == 0 or step.used + group_seqs <= step.decode_room
        return room and not over_cap(
            step.scheduled_decodes, step.batch_seqs + group_seqs, step.seq_cap
        )

    def _schedule_running_prefills(self, step: _Step) -> None:
        """The next chunk of each running prefill, FCFS while tokens are left: those with
        no step in flight, and those whose earlier chunks are still in the pipeline (the new
        chunk follows them through every stage; it needs no new block)."""
        pending = sorted([*step.prefills, *step.chunks_behind], key=lambda g: g.arrival_time)
        for seq_group in pending:
            room = step.prefill_room()
            chunk = _chunk(seq_group, SequenceStatus.RUNNING, room, self._cap, self.sizer)
            if chunk > 0:
                step.take(seq_group, chunk, prefill=True)

    def _swap_in(self, step: _Step) -> None:
        """Swapped groups back in, FCFS, while their chunk or decode tokens fit."""
        sched = self.sched
        sched.sort_swapped()
        num_seqs = sched.num_running_seqs()
        while (seq_group := sched.next_swappable(step.out, num_seqs)) is not None:
            num_new_seqs = seq_group.get_max_num_running_seqs()
            is_prefill = seq_group.is_prefill()
            if is_prefill:
                room = step.budget - step.used
                tokens = _chunk(seq_group, SequenceStatus.SWAPPED, room, self._cap, self.sizer)
                if tokens == 0:
                    break
            else:
                tokens = seq_group.num_seqs(status=SequenceStatus.SWAPPED)
                # Swapped work is not in the budget's share: the first group always fits.
                if step.used > 0 and step.used + tokens > step.budget:
                    break
            sched.swap_in(seq_group, step.out)
            step.take(seq_group, tokens, prefill=is_prefill)
            num_seqs += num_new_seqs

    def _admit_prompts(self, step: _Step) -> None:
        """New prompts, FCFS: the first chunk of each while tokens are left (with several
        partial prefills, a long prompt is passed over while enough long ones run)."""
        sched, budget = self.sched, self.sched.budget
        num_seqs = sched.num_running_seqs()
        partial = step.partial

        def long_held_back(seq_group: SequenceGroup) -> bool:
            return partial is not None and not partial.may_admit(_waiting_tokens_left(seq_group))

        skip = long_held_back if self.partial.enabled else None
        while step.used < step.budget and (head := sched.next_admissible(step.out, skip)):
            seq_group, waiting_seqs, num_prompt_tokens = head
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if num_seqs + num_new_seqs > budget.max_num_seqs:
                break
            new_tokens = num_prompt_tokens - sched.block_manager.num_cached_tokens(seq_group)
            max_tokens = budget.max_num_batched_tokens
            if len(waiting_seqs) == 1:
                room = min(step.prefill_room(), self._cap)
                cached = num_prompt_tokens - new_tokens
                sizer = self.sizer
                chunk = sizer.chunk(cached, new_tokens, room) if sizer else min(new_tokens, room)
            elif new_tokens > max_tokens:
                # Several sequences (diverged before a recompute) are never chunked: if
                # together they exceed a step's tokens they could never run.
                logger.warning(
                    "Input prompt (%d tokens) is too long and exceeds limit of %d",
                    new_tokens,
                    max_tokens,
                )
                sched.ignore(seq_group, step.out)
                continue
            elif step.used + new_tokens <= max_tokens:
                chunk = new_tokens
            else:
                break
            if partial is not None:
                partial.admitted(_waiting_tokens_left(seq_group))
            sched.admit(seq_group, waiting_seqs)
            step.take(seq_group, chunk, prefill=True)
            num_seqs += num_new_seqs


def _phase(seq_group: SequenceGroup) -> int:
    """The chunked policy's order of `running`: in flight or finished (0), decoding (1),
    prefilling (2)."""
    if seq_group.is_in_flight() or seq_group.is_finished():
        return 0
    return 2 if seq_group.is_prefill() else 1


def _tokens_left(seq_group: SequenceGroup) -> int:
    """Prompt tokens of a running prefill neither computed nor in a chunk in flight."""
    seqs = seq_group.get_seqs(status=SequenceStatus.RUNNING)
    return sum(s.get_num_new_tokens() for s in seqs) - seq_group.prefill_tokens_in_flight()


def _waiting_tokens_left(seq_group: SequenceGroup) -> int:
    """Tokens a waiting prompt has to prefill (vLLM counts its first sequence's, cached
    prefix included)."""
    seqs = seq_group.get_seqs(status=SequenceStatus.WAITING)
    return seqs[0].get_num_new_tokens() if seqs else 0


def _chunk(
    seq_group: SequenceGroup,
    status: SequenceStatus,
    room: int,
    cap: int,
    sizer: ChunkSizer | None,
) -> int:
    """Tokens of a prefilling group this step can take (0 if none fit): the prompt tokens
    neither computed nor in an earlier chunk still in flight; for one sequence at most `cap`,
    and what `sizer` gives a chunk starting where this one does."""
    seqs = seq_group.get_seqs(status=status)
    in_flight = seq_group.prefill_tokens_in_flight()
    new_tokens = sum(seq.get_num_new_tokens() for seq in seqs) - in_flight
    if len(seqs) == 1:
        room = min(room, cap)
        if sizer is None or new_tokens <= 0 or room <= 0:
            return max(0, min(new_tokens, room))
        return sizer.chunk(seqs[0].data.get_num_computed_tokens() + in_flight, new_tokens, room)
    return new_tokens if new_tokens <= room else 0


def _pop_victim(
    decodes: collections.deque[SequenceGroup], prefills: collections.deque[SequenceGroup]
) -> SequenceGroup | None:
    """The latest-arriving group not scheduled yet, prefilling or decoding."""
    if not decodes and not prefills:
        return None
    if not prefills or (decodes and decodes[-1].arrival_time >= prefills[-1].arrival_time):
        return decodes.pop()
    return prefills.pop()
