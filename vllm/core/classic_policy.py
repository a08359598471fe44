"""The scheduler's default policy, vLLM V0's: a step runs either new prompts (whole) or decodes.

`Scheduler.schedule` calls `ClassicPolicy.schedule`; the queues, admission, swap-in,
preemption and scheduling ahead are the scheduler's (`vllm.core.scheduler`), which the policy
sees as `PolicyQueues`: it decides, the scheduler applies. Imports no torch.
"""

from __future__ import annotations

import collections

from vllm.core.budget import over_cap
from vllm.core.policy_api import PolicyQueues, SchedulerOutputs
from vllm.sequence import SequenceGroup, SequenceStatus


class ClassicPolicy:
    """FCFS whole-prompt or decode steps (`enable_chunked_prefill` off).

    Like vLLM V0, swapped groups are resumed before any new prompt is admitted; a decode that
    needs a block preempts the latest-arriving group that is not in flight."""

    def __init__(self, queues: PolicyQueues) -> None:
        self.sched = queues

    def schedule(self, out: SchedulerOutputs, seq_cap: int, step_no: int) -> None:
        """Fill `out` with one step, at most `seq_cap` sequences (the first group always
        fits); `step_no` is the step it will be submitted as."""
        if not self.sched.swapped:
            self._schedule_prompts(out, seq_cap)
            if out.scheduled_seq_groups or out.ignored_seq_groups:
                out.prompt_run = True
                return
        self._schedule_decodes(out, seq_cap, step_no)
        if out.num_preempted == 0 and self.sched.swapped:
            # Resuming swapped groups right after preempting would only thrash.
            self._swap_in(out, seq_cap)
        out.num_batched_tokens = sum(
            g.num_seqs(status=SequenceStatus.RUNNING) for g in out.scheduled_seq_groups
        )

    def _schedule_prompts(self, out: SchedulerOutputs, seq_cap: int) -> None:
        sched, budget = self.sched, self.sched.budget
        if not sched.waiting:
            return
        num_seqs = sched.num_running_seqs()
        batch_seqs = 0
        while (head := sched.next_admissible(out)) is not None:
            seq_group, waiting_seqs, num_prompt_tokens = head
            # A prefix found in the prefix cache is not computed again.
            num_new_tokens = num_prompt_tokens - sched.block_manager.num_cached_tokens(seq_group)
            if out.num_batched_tokens + num_new_tokens > budget.max_num_batched_tokens:
                break
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if num_seqs + num_new_seqs > budget.max_num_seqs:
                break
            if over_cap(out.scheduled_seq_groups, batch_seqs + num_new_seqs, seq_cap):
                break
            batch_seqs += num_new_seqs
            sched.admit(seq_group, waiting_seqs)
            out.scheduled_seq_groups.append(seq_group)
            out.token_chunk_sizes[seq_group.request_id] = waiting_seqs[0].get_num_new_tokens()
            out.num_batched_tokens += num_new_tokens
            num_seqs += num_new_seqs

    def _schedule_decodes(self, out: SchedulerOutputs, seq_cap: int, step_no: int) -> None:
        sched = self.sched
        scheduled = out.scheduled_seq_groups
        # FCFS: earliest arrival has the highest priority (stable for equal times). The
        # groups stay in `running` unless the scheduler preempts them.
        sched.sort_running(lambda g: (0, g.arrival_time))
        pending = collections.deque(sched.running)
        self._batch_seqs = 0
        while pending:
            seq_group = pending.popleft()
            if seq_group.is_finished():
                continue
            group_seqs = seq_group.num_seqs(status=SequenceStatus.RUNNING)
            if over_cap(scheduled, self._batch_seqs + group_seqs, seq_cap):
                continue  # this micro-batch is full; the group waits for the next one
            if seq_group.is_in_flight():
                if sched.can_go_ahead(seq_group, step_no) and sched.try_schedule_ahead(
                    seq_group, out
                ):
                    self._take(out, seq_group, group_seqs)
                continue
            if sched.grow_or_preempt(seq_group, out, lambda: _pop_victim(pending)):
                self._take(out, seq_group, group_seqs)

    def _swap_in(self, out: SchedulerOutputs, seq_cap: int) -> None:
        sched = self.sched
        sched.sort_swapped()
        num_seqs = sched.num_running_seqs()
        while (swapped := sched.next_swappable(out, num_seqs)) is not None:
            num_new_seqs = swapped.get_max_num_running_seqs()
            if over_cap(out.scheduled_seq_groups, self._batch_seqs + num_new_seqs, seq_cap):
                break
            self._batch_seqs += num_new_seqs
            sched.swap_in(swapped, out)
            out.scheduled_seq_groups.append(swapped)
            out.token_chunk_sizes[swapped.request_id] = swapped.num_seqs(
                status=SequenceStatus.RUNNING
            )
            num_seqs += num_new_seqs

    def _take(self, out: SchedulerOutputs, seq_group: SequenceGroup, group_seqs: int) -> None:
        out.scheduled_seq_groups.append(seq_group)
        out.token_chunk_sizes[seq_group.request_id] = group_seqs
        self._batch_seqs += group_seqs


def _pop_victim(pending: collections.deque[SequenceGroup]) -> SequenceGroup | None:
    """Remove and return the lowest-priority pending group that is not in flight."""
    for index in range(len(pending) - 1, -1, -1):
        if not pending[index].is_in_flight():
            victim = pending[index]
            del pending[index]
            return victim
    return None
