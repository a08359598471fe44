"""What a scheduling policy sees of the scheduler, and the step it fills. Imports no torch.

A policy (`ClassicPolicy`, `ChunkedPolicy`) decides which groups one step runs; it never writes
the scheduler's queues. It reads them through `PolicyQueues` (read-only sequences) and asks
the scheduler to apply each decision: order `running` by the policy's priority, admit or
ignore the head of `waiting`, swap the head of `swapped` in, make room for a group (preempting
the victims the policy picks), schedule a group ahead. The scheduler (`vllm.core.scheduler`)
is the one writer of its queues; it implements this protocol, so the policies never import it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vllm.core.budget import MicroBatchBudget
from vllm.core.chunk_sizer import StepCost
from vllm.core.step_writer import StepRecords
from vllm.sequence import Sequence as Seq
from vllm.sequence import SequenceGroup

__all__ = ["BlockQueries", "PolicyQueues", "SchedulerOutputs"]


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
    # Groups scheduled ahead -> the step number of their step in flight: each of their
    # sequences feeds the token that step samples.
    ahead: dict[str, int] = field(default_factory=dict)
    # Groups with earlier chunks of their prompt still in flight (chunked pipelining) -> the
    # prompt tokens those chunks feed: this step's chunk starts after them.
    chunk_offsets: dict[str, int] = field(default_factory=dict)
    # Speculative decodes: request id -> seq id -> the draft tokens it verifies this step
    # (their slots are appended; `vllm.spec_decode.planner`).
    drafts: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    # The step's work (tokens fed, query-key pairs scored; the pairs are counted only when a
    # chunk sizer runs): with its measured duration it calibrates the sizer
    # (`vllm.core.chunk_sizer`).
    cost: StepCost = StepCost(0, 0)
    # The step number this batch was scheduled as (0 when it is empty).
    step_no: int = 0
    # The step's records as written, for `Scheduler.commit_step`.
    written: StepRecords | None = None

    def is_empty(self) -> bool:
        """True when there is nothing to run and no block to move or copy."""
        return not (
            self.scheduled_seq_groups
            or self.blocks_to_swap_in
            or self.blocks_to_swap_out
            or self.blocks_to_copy
        )


class BlockQueries(Protocol):
    """The one block-manager question a policy asks itself (the others are the scheduler's)."""

    def num_cached_tokens(self, seq_group: SequenceGroup) -> int:
        """Prompt tokens of `seq_group` the prefix cache already holds."""
        ...


class PolicyQueues(Protocol):
    """The scheduler as a policy sees it: its queues read-only, the batch budget, and the
    operations through which the scheduler applies the policy's decisions."""

    @property
    def waiting(self) -> Sequence[SequenceGroup]: ...

    @property
    def running(self) -> Sequence[SequenceGroup]: ...

    @property
    def swapped(self) -> Sequence[SequenceGroup]: ...

    @property
    def budget(self) -> MicroBatchBudget: ...

    @property
    def block_manager(self) -> BlockQueries: ...

    def num_running_seqs(self) -> int: ...

    def sort_running(self, key: Callable[[SequenceGroup], tuple[int, float]]) -> None:
        """Order `running` by the policy's priority (a stable sort)."""
        ...

    def next_admissible(
        self, out: SchedulerOutputs, passed_over: Callable[[SequenceGroup], bool] | None = None
    ) -> tuple[SequenceGroup, list[Seq], int] | None:
        """The first waiting group (skipping those `passed_over`) that can be admitted now."""
        ...

    def admit(self, seq_group: SequenceGroup, waiting_seqs: list[Seq]) -> None: ...

    def ignore(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None: ...

    def sort_swapped(self) -> None: ...

    def next_swappable(self, out: SchedulerOutputs, num_seqs: int) -> SequenceGroup | None: ...

    def swap_in(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None: ...

    def grow_or_preempt(
        self,
        seq_group: SequenceGroup,
        out: SchedulerOutputs,
        next_victim: Callable[[], SequenceGroup | None],
    ) -> bool: ...

    def can_go_ahead(self, seq_group: SequenceGroup, step_no: int) -> bool: ...

    def can_pipeline_chunk(self, seq_group: SequenceGroup) -> bool: ...

    def try_schedule_ahead(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> bool: ...
