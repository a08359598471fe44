"""What the scheduler and its two policies share: `SchedulerOutputs`, one step's decisions, and
`SchedulerState`, the scheduler state and machinery the policy mixins rely on (for mypy).

Here rather than in `scheduler.py` so the policy modules need not import the scheduler that
inherits from them (no import cycle); `vllm.core.scheduler` re-exports `SchedulerOutputs`, its
public home. Imports no torch.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from vllm.config import SchedulerConfig
from vllm.core.block_manager import BlockSpaceManager
from vllm.sequence import Sequence, SequenceGroup


@dataclass
class SchedulerOutputs:
    """One step's decisions: the groups to run and the block operations to apply first."""

    scheduled_seq_groups: list[SequenceGroup] = field(default_factory=list)
    prompt_run: bool = False
    num_batched_tokens: int = 0
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    ignored_seq_groups: list[SequenceGroup] = field(default_factory=list)
    num_preempted: int = 0
    # request id -> tokens this step feeds for the group (1 per sequence for a decode).
    token_chunk_sizes: dict[str, int] = field(default_factory=dict)
    # Groups scheduled ahead -> the batch number of their step in flight: each of their
    # sequences feeds the token that step samples.
    ahead: dict[str, int] = field(default_factory=dict)
    # This batch's number (counting non-empty batches since the scheduler was made).
    batch_no: int = 0

    def is_empty(self) -> bool:
        """True when there is nothing to run and no block to move or copy."""
        return not (
            self.scheduled_seq_groups
            or self.blocks_to_swap_in
            or self.blocks_to_swap_out
            or self.blocks_to_copy
        )


class SchedulerState(abc.ABC):
    """The part of `vllm.core.scheduler.Scheduler` a policy mixin may use: its queues and
    budgets, and the shared machinery (admission, the micro-batch cap, scheduling ahead,
    preemption). For type checking only: the policies inherit from it under `TYPE_CHECKING`
    (at run time from `object`), so mypy checks that `Scheduler` provides every member with
    these types. An abstract class rather than a Protocol: mypy loses the type of a Protocol
    member that a subclass reassigns (`self.running = ...`)."""

    scheduler_config: SchedulerConfig
    pipeline_parallel_size: int
    block_manager: BlockSpaceManager
    waiting: collections.deque[SequenceGroup]
    running: collections.deque[SequenceGroup]
    swapped: collections.deque[SequenceGroup]
    # Groups with at least one step inside the pipeline.
    in_flight: set[str]
    # The longest prompt a group may have (tokens).
    prompt_limit: int
    # Whether this step admitted a new group.
    _admitted: bool

    @abc.abstractmethod
    def _num_running_seqs(self) -> int: ...

    @abc.abstractmethod
    def _batch_full(
        self, scheduled: Collection[SequenceGroup], batch_seqs: int, num_seqs: int
    ) -> bool: ...

    @abc.abstractmethod
    def _next_admissible(
        self, out: SchedulerOutputs
    ) -> tuple[SequenceGroup, list[Sequence], int] | None: ...

    @abc.abstractmethod
    def _admit(self, seq_group: SequenceGroup, waiting_seqs: list[Sequence]) -> None: ...

    @abc.abstractmethod
    def _ignore(self, seq_group: SequenceGroup, ignored: list[SequenceGroup]) -> None: ...

    @abc.abstractmethod
    def _next_swappable(self, out: SchedulerOutputs, num_seqs: int) -> SequenceGroup | None: ...

    @abc.abstractmethod
    def _swap_in(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None: ...

    @abc.abstractmethod
    def _can_go_ahead(self, seq_group: SequenceGroup) -> bool: ...

    @abc.abstractmethod
    def _schedule_ahead(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> bool: ...

    @abc.abstractmethod
    def _grow_or_preempt(
        self,
        seq_group: SequenceGroup,
        out: SchedulerOutputs,
        next_victim: Callable[[], SequenceGroup | None],
    ) -> bool: ...

    @abc.abstractmethod
    def _append_slots(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None: ...
