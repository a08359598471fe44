"""Taking groups off the heads of the scheduler's queues, for both policies: admitting the
first waiting prompt, swapping the first swapped group back in, and ending those that can
never fit (vLLM's warnings and FINISHED_IGNORED).

A mixin of `vllm.core.scheduler.Scheduler`, which owns the state (see `SchedulerState`).
Imports no torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tests.unit.reference_scheduler.scheduler_types import SchedulerOutputs
from vllm.core.block_manager import AllocStatus
from vllm.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from tests.unit.reference_scheduler.scheduler_types import SchedulerState as _SchedulerState
else:
    _SchedulerState = object

# The scheduler's logger: its warnings read the same whichever policy runs.
logger = logging.getLogger("vllm.core.scheduler")


class QueueHeads(_SchedulerState):
    """Admission and swap-in of the queue heads.

    Scheduler state it reads: `prompt_limit`, `scheduler_config` (max_num_seqs),
    `block_manager` (can the group be allocated / swapped in, is its prefix pending). It
    writes: `waiting` and `swapped` (their heads leave), `running` (admitted or swapped-in
    groups join it), `_admitted`, the sequences' statuses and their blocks."""

    def _admit(self, seq_group: SequenceGroup, waiting_seqs: list[Sequence]) -> None:
        cached = self.block_manager.allocate(seq_group)
        for seq in waiting_seqs:
            seq.status = SequenceStatus.RUNNING
            if cached:
                seq.data.update_num_computed_tokens(cached)
        self.running.append(seq_group)
        self._admitted = True

    def _next_admissible(
        self, out: SchedulerOutputs
    ) -> tuple[SequenceGroup, list[Sequence], int] | None:
        """The first waiting group if it can be admitted now: (group, its waiting sequences,
        their tokens -- a recomputed group re-prefills its generated tokens as well). Groups
        that can never fit are finished as ignored on the way; None when the head must wait
        or nothing waits. The group stays at the head of `waiting` until `_admit`."""
        while self.waiting:
            seq_group = self.waiting[0]
            waiting_seqs = seq_group.get_seqs(status=SequenceStatus.WAITING)
            num_prompt_tokens = sum(seq.get_len() for seq in waiting_seqs)
            admission = self._admission(seq_group, num_prompt_tokens, out)
            if admission is AllocStatus.LATER:
                return None
            if admission is AllocStatus.OK:
                return seq_group, waiting_seqs, num_prompt_tokens
        return None

    def _next_swappable(self, out: SchedulerOutputs, num_seqs: int) -> SequenceGroup | None:
        """The first swapped group if it can come back now (blocks free, and room for its
        sequences next to the `num_seqs` running). Groups that can never come back are
        finished as ignored on the way; None when the head must wait or nothing is swapped."""
        while self.swapped:
            seq_group = self.swapped[0]
            status = self.block_manager.can_swap_in(seq_group)
            if status == AllocStatus.NEVER:
                self._ignore_swapped(seq_group, out)
                continue
            if status == AllocStatus.LATER:
                return None
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if num_seqs + num_new_seqs > self.scheduler_config.max_num_seqs:
                return None
            return seq_group
        return None

    def _swap_in(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        """Bring the head of `swapped` back: its blocks in (applied before the step), its
        sequences running, a slot for the step's token, and into `running`."""
        self.swapped.popleft()
        out.blocks_to_swap_in.update(self.block_manager.swap_in(seq_group))
        for seq in seq_group.get_seqs(status=SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.RUNNING
        self._append_slots(seq_group, out)
        self.running.append(seq_group)

    def _admission(
        self, seq_group: SequenceGroup, num_prompt_tokens: int, out: SchedulerOutputs
    ) -> AllocStatus:
        """Whether the first waiting group can be admitted now (OK), must wait (LATER: no
        blocks yet, or its prefix is being computed in flight and it waits to reuse it), or
        never fits (NEVER: it was finished as ignored, with vLLM's warning)."""
        if _over_prompt_limit(self, seq_group, num_prompt_tokens):
            logger.warning(
                "Input prompt (%d tokens) is too long and exceeds limit of %d",
                num_prompt_tokens,
                self.prompt_limit,
            )
            self._ignore(seq_group, out.ignored_seq_groups)
            return AllocStatus.NEVER
        status = self.block_manager.can_allocate(seq_group)
        if status == AllocStatus.LATER or self.block_manager.prefix_pending(seq_group):
            return AllocStatus.LATER
        if status == AllocStatus.NEVER:
            logger.warning(
                "Input prompt (%d tokens) is too long and exceeds the capacity of block_manager",
                num_prompt_tokens,
            )
            self._ignore(seq_group, out.ignored_seq_groups)
        return status

    def _ignore(self, seq_group: SequenceGroup, ignored: list[SequenceGroup]) -> None:
        for seq in seq_group.get_seqs(status=SequenceStatus.WAITING):
            seq.status = SequenceStatus.FINISHED_IGNORED
        ignored.append(seq_group)
        self.waiting.popleft()

    def _ignore_swapped(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        """vLLM's rule for a swapped group that needs more blocks than the whole cache: it
        can never run again, so it ends (FINISHED_IGNORED, finish_reason "length")."""
        logger.warning(
            "Failing the request %s because there's not enough kv cache blocks to run the "
            "entire sequence.",
            seq_group.request_id,
        )
        self.swapped.popleft()
        for seq in seq_group.get_seqs(status=SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.FINISHED_IGNORED
            self.block_manager.free(seq)
        out.ignored_seq_groups.append(seq_group)


def _over_prompt_limit(sched: Any, seq_group: SequenceGroup, num_prompt_tokens: int) -> bool:
    """Whether the waiting group can never be prefilled. With chunked prefill each sequence
    must fit the context window: samples that diverged before a recompute each re-prefill
    their own tokens (their sum may pass max_model_len; the chunked policy checks it against
    the step's tokens). Without it, all of them must fit one step."""
    if not sched.scheduler_config.enable_chunked_prefill:
        return num_prompt_tokens > sched.prompt_limit
    waiting = seq_group.get_seqs(status=SequenceStatus.WAITING)
    return max((seq.get_len() for seq in waiting), default=0) > sched.prompt_limit
