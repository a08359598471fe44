"""The scheduler's default policy, vLLM V0's: a step runs either new prompts (whole) or decodes.

A mixin of `vllm.core.scheduler.Scheduler`, which owns the state and the shared machinery
(see `SchedulerState`). Imports no torch.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from tests.unit.reference_scheduler.scheduler_types import SchedulerOutputs
from vllm.sequence import SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from tests.unit.reference_scheduler.scheduler_types import SchedulerState as _SchedulerState
else:
    _SchedulerState = object


class ClassicPolicy(_SchedulerState):
    """FCFS whole-prompt or decode steps (`enable_chunked_prefill` off).

    Scheduler state it reads: `scheduler_config` (max_num_batched_tokens, max_num_seqs),
    `in_flight`, `block_manager` (cached prefix tokens, whether a swapped group fits). It
    writes: `waiting` (admitted or ignored prompts leave it), `running` (rebuilt each decode
    step), `swapped` (sorted; groups leave it when swapped in) and their sequences' statuses,
    through the Scheduler's admission, micro-batch cap, scheduling-ahead and preemption
    helpers (`SchedulerState`)."""

    def _schedule(self) -> SchedulerOutputs:
        # Like vLLM V0: swapped groups are resumed before any new prompt is admitted.
        if not self.swapped:
            prompt_outputs = self._schedule_prompts()
            if prompt_outputs.scheduled_seq_groups or prompt_outputs.ignored_seq_groups:
                return prompt_outputs
        return self._schedule_decodes()

    def _schedule_prompts(self) -> SchedulerOutputs:
        config = self.scheduler_config
        out = SchedulerOutputs(prompt_run=True)
        if not self.waiting:
            return out
        num_seqs = self._num_running_seqs()
        batch_seqs = 0
        while (head := self._next_admissible(out)) is not None:
            seq_group, waiting_seqs, num_prompt_tokens = head
            # A prefix found in the prefix cache is not computed again.
            num_new_tokens = num_prompt_tokens - self.block_manager.num_cached_tokens(seq_group)
            if out.num_batched_tokens + num_new_tokens > config.max_num_batched_tokens:
                break
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if num_seqs + num_new_seqs > config.max_num_seqs:
                break
            if self._batch_full(out.scheduled_seq_groups, batch_seqs, num_new_seqs):
                break
            batch_seqs += num_new_seqs
            self.waiting.popleft()
            self._admit(seq_group, waiting_seqs)
            out.scheduled_seq_groups.append(seq_group)
            out.token_chunk_sizes[seq_group.request_id] = waiting_seqs[0].get_num_new_tokens()
            out.num_batched_tokens += num_new_tokens
            num_seqs += num_new_seqs
        return out

    def _schedule_decodes(self) -> SchedulerOutputs:
        out = SchedulerOutputs()
        scheduled = out.scheduled_seq_groups
        # FCFS: earliest arrival has the highest priority (stable for equal times).
        pending = collections.deque(sorted(self.running, key=lambda g: g.arrival_time))
        self.running = collections.deque()
        batch_seqs = 0
        while pending:
            seq_group = pending.popleft()
            if seq_group.is_finished():
                self.running.append(seq_group)
                continue
            group_seqs = seq_group.num_seqs(status=SequenceStatus.RUNNING)
            if self._batch_full(scheduled, batch_seqs, group_seqs):
                # This micro-batch is full; the group waits for the next one.
                self.running.append(seq_group)
                continue
            if seq_group.request_id in self.in_flight:
                self.running.append(seq_group)
                if self._can_go_ahead(seq_group) and self._schedule_ahead(seq_group, out):
                    scheduled.append(seq_group)
                    out.token_chunk_sizes[seq_group.request_id] = group_seqs
                    batch_seqs += group_seqs
                continue
            if self._grow_or_preempt(seq_group, out, lambda: self._pop_victim(pending)):
                self.running.append(seq_group)
                scheduled.append(seq_group)
                out.token_chunk_sizes[seq_group.request_id] = group_seqs
                batch_seqs += group_seqs

        # Resuming swapped groups right after preempting would only thrash.
        if out.num_preempted == 0 and self.swapped:
            self.swapped = collections.deque(sorted(self.swapped, key=lambda g: g.arrival_time))
            num_seqs = self._num_running_seqs()
            while (swapped := self._next_swappable(out, num_seqs)) is not None:
                num_new_seqs = swapped.get_max_num_running_seqs()
                if self._batch_full(scheduled, batch_seqs, num_new_seqs):
                    break
                batch_seqs += num_new_seqs
                self._swap_in(swapped, out)
                scheduled.append(swapped)
                out.token_chunk_sizes[swapped.request_id] = swapped.num_seqs(
                    status=SequenceStatus.RUNNING
                )
                num_seqs += num_new_seqs

        out.num_batched_tokens = sum(g.num_seqs(status=SequenceStatus.RUNNING) for g in scheduled)
        return out

    def _pop_victim(self, pending: collections.deque[SequenceGroup]) -> SequenceGroup | None:
        """Remove and return the lowest-priority pending group that is not in flight."""
        for index in range(len(pending) - 1, -1, -1):
            if pending[index].request_id not in self.in_flight:
                victim = pending[index]
                del pending[index]
                return victim
        return None
