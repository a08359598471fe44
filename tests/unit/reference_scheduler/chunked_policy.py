"""The scheduler's chunked-prefill policy, vLLM 0.5's (`enable_chunked_prefill`).

A step takes the running decodes first, then prefill chunks up to `max_num_batched_tokens`,
so a long prompt is prefilled over several steps next to the decodes (between two chunks its
group is in flight like a decode: chunks reach the cache in order). With pipeline parallelism
the micro-batches are balanced by tokens (`_token_budget`).

A mixin of `vllm.core.scheduler.Scheduler`, which owns the state and the shared machinery
(see `SchedulerState`). Imports no torch.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

from tests.unit.reference_scheduler.scheduler_types import SchedulerOutputs
from vllm.sequence import SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from tests.unit.reference_scheduler.scheduler_types import SchedulerState as _SchedulerState
else:
    _SchedulerState = object

# The scheduler's logger: its warnings read the same whichever policy runs.
logger = logging.getLogger("vllm.core.scheduler")


class ChunkedPolicy(_SchedulerState):
    """Decodes first, then prefill chunks, within one token budget per step.

    Scheduler state it reads: `scheduler_config` (max_num_batched_tokens, max_num_seqs),
    `pipeline_parallel_size`, `in_flight`, `block_manager` (cached prefix tokens, whether a
    swapped group fits), the tokens left to prefill in `running` and `waiting`. It writes:
    `waiting` (admitted or ignored prompts leave it), `running` (rebuilt each step), `swapped`
    (sorted; groups leave it when swapped in) and their sequences' statuses, through the
    Scheduler's admission, micro-batch cap, scheduling-ahead and preemption helpers
    (`SchedulerState`)."""

    def _token_budget(self) -> tuple[int, int]:
        """(this micro-batch's token budget, the most of it decodes may take).

        With N pipeline stages every stage runs every micro-batch, so the pipeline moves at
        the pace of the largest one. One round through the pipeline runs every decoding
        sequence once plus prefill chunks up to max_num_batched_tokens; each micro-batch takes
        ~1/N of the decodes and ~1/N of that prefill work (more if fewer decodes are ready), so
        a long prompt is spread over several micro-batches instead of stalling the one that
        holds it, and prefills always progress next to many decodes."""
        budget = self.scheduler_config.max_num_batched_tokens
        stages = self.pipeline_parallel_size
        if stages == 1:
            return budget, budget
        decode_tokens = 0
        prefill_tokens = 0
        for group in self.running:
            for seq in group.get_seqs(status=SequenceStatus.RUNNING):
                if seq.is_prefill():
                    prefill_tokens += seq.get_num_new_tokens()
                else:
                    decode_tokens += 1
        for group in self.waiting:
            prefill_tokens += sum(s.get_len() for s in group.get_seqs(SequenceStatus.WAITING))
        decode_share = -(-decode_tokens // stages)
        prefill_share = -(-min(prefill_tokens, budget) // stages)
        return max(1, min(budget, decode_share + prefill_share)), max(1, decode_share)

    def _schedule_chunked(self) -> SchedulerOutputs:
        """vLLM 0.5's chunked-prefill policy: running decodes first, then prefill chunks of
        running groups, swapped groups, and new prompts, within one token budget."""
        config = self.scheduler_config
        out = SchedulerOutputs()
        budget, decode_budget = self._token_budget()
        decode_room = min(budget, decode_budget)
        used = 0
        batch_seqs = 0
        decodes: collections.deque[SequenceGroup] = collections.deque()
        prefills: collections.deque[SequenceGroup] = collections.deque()
        pending = sorted(self.running, key=lambda g: g.arrival_time)
        self.running = collections.deque()
        ahead: list[SequenceGroup] = []
        for seq_group in pending:
            if seq_group.request_id in self.in_flight or seq_group.is_finished():
                self.running.append(seq_group)
                if not seq_group.is_finished() and self._can_go_ahead(seq_group):
                    ahead.append(seq_group)
            elif seq_group.is_prefill():
                prefills.append(seq_group)
            else:
                decodes.append(seq_group)

        scheduled_decodes: list[SequenceGroup] = []
        while decodes:
            seq_group = decodes.popleft()
            group_seqs = seq_group.num_seqs(status=SequenceStatus.RUNNING)
            # The first group of a batch always fits (a lone group of several samples).
            if (used > 0 and used + group_seqs > decode_room) or self._batch_full(
                scheduled_decodes, batch_seqs, group_seqs
            ):
                self.running.append(seq_group)
                continue
            if self._grow_or_preempt(
                seq_group, out, lambda: self._pop_chunked_victim(decodes, prefills)
            ):
                self.running.append(seq_group)
                scheduled_decodes.append(seq_group)
                out.token_chunk_sizes[seq_group.request_id] = group_seqs
                used += group_seqs
                batch_seqs += group_seqs
        for seq_group in ahead:
            group_seqs = seq_group.num_seqs(status=SequenceStatus.RUNNING)
            if (used > 0 and used + group_seqs > decode_room) or self._batch_full(
                scheduled_decodes, batch_seqs, group_seqs
            ):
                continue
            if self._schedule_ahead(seq_group, out):
                scheduled_decodes.append(seq_group)
                out.token_chunk_sizes[seq_group.request_id] = group_seqs
                used += group_seqs
                batch_seqs += group_seqs

        scheduled_prefills: list[SequenceGroup] = []
        for seq_group in prefills:
            self.running.append(seq_group)
            chunk = self._chunk(seq_group, SequenceStatus.RUNNING, budget - used)
            if chunk > 0:
                scheduled_prefills.append(seq_group)
                out.token_chunk_sizes[seq_group.request_id] = chunk
                used += chunk

        if out.num_preempted == 0 and self.swapped:
            used = self._swap_in_chunked(out, budget, used, scheduled_prefills, scheduled_decodes)

        # New prompts only when nothing waits to be swapped back in (it would starve) and
        # nothing was just preempted for lack of blocks.
        if out.num_preempted == 0 and not self.swapped:
            num_seqs = self._num_running_seqs()
            while used < budget and (head := self._next_admissible(out)) is not None:
                seq_group, waiting_seqs, num_prompt_tokens = head
                num_new_seqs = seq_group.get_max_num_running_seqs()
                if num_seqs + num_new_seqs > config.max_num_seqs:
                    break
                cached = self.block_manager.num_cached_tokens(seq_group)
                new_tokens = num_prompt_tokens - cached
                max_tokens = config.max_num_batched_tokens
                if len(waiting_seqs) == 1:
                    chunk = min(new_tokens, budget - used)
                elif new_tokens > max_tokens:
                    # Several sequences (diverged before a recompute) are never chunked: if
                    # together they exceed a step's tokens they could never run.
                    logger.warning(
                        "Input prompt (%d tokens) is too long and exceeds limit of %d",
                        new_tokens,
                        max_tokens,
                    )
                    self._ignore(seq_group, out.ignored_seq_groups)
                    continue
                elif used + new_tokens <= max_tokens:
                    chunk = new_tokens
                else:
                    break
                self.waiting.popleft()
                self._admit(seq_group, waiting_seqs)
                scheduled_prefills.append(seq_group)
                out.token_chunk_sizes[seq_group.request_id] = chunk
                used += chunk
                num_seqs += num_new_seqs

        out.scheduled_seq_groups = scheduled_prefills + scheduled_decodes
        out.prompt_run = bool(scheduled_prefills)
        out.num_batched_tokens = used
        return out

    def _chunk(self, seq_group: SequenceGroup, status: SequenceStatus, room: int) -> int:
        """Tokens of a prefilling group this step can take (0 if none fit)."""
        seqs = seq_group.get_seqs(status=status)
        new_tokens = sum(seq.get_num_new_tokens() for seq in seqs)
        if len(seqs) == 1:
            return max(0, min(new_tokens, room))
        return new_tokens if new_tokens <= room else 0

    def _swap_in_chunked(
        self,
        out: SchedulerOutputs,
        budget: int,
        used: int,
        scheduled_prefills: list[SequenceGroup],
        scheduled_decodes: list[SequenceGroup],
    ) -> int:
        self.swapped = collections.deque(sorted(self.swapped, key=lambda g: g.arrival_time))
        num_seqs = self._num_running_seqs()
        while (seq_group := self._next_swappable(out, num_seqs)) is not None:
            num_new_seqs = seq_group.get_max_num_running_seqs()
            is_prefill = seq_group.is_prefill()
            if is_prefill:
                tokens = self._chunk(seq_group, SequenceStatus.SWAPPED, budget - used)
                if tokens == 0:
                    break
            else:
                tokens = seq_group.num_seqs(status=SequenceStatus.SWAPPED)
                if used > 0 and used + tokens > budget:
                    break
            self._swap_in(seq_group, out)
            (scheduled_prefills if is_prefill else scheduled_decodes).append(seq_group)
            out.token_chunk_sizes[seq_group.request_id] = tokens
            used += tokens
            num_seqs += num_new_seqs
        return used

    def _pop_chunked_victim(
        self, decodes: collections.deque[SequenceGroup], prefills: collections.deque[SequenceGroup]
    ) -> SequenceGroup | None:
        """The latest-arriving group not scheduled yet, prefilling or decoding."""
        if not decodes and not prefills:
            return None
        if not prefills or (decodes and decodes[-1].arrival_time >= prefills[-1].arrival_time):
            return decodes.pop()
        return prefills.pop()
