"""The micro-batches inside the pipeline: one owner, in submission order (torch-free).

The engine schedules a batch (the scheduler writes its records once: `vllm.core.step_writer`),
the queue wraps them in a step message and submits it to the executor, which returns the
step's future at once. Up to `max_concurrent_batches` batches are in flight: the pipeline depth, or
twice it when decodes are scheduled ahead of their previous step's output (the asynchronous
pipeline: the last stage then sends its sampled ids straight to the first stage, and the
queue tells the first stage which steps' ids to wait for). Outputs are collected oldest
first. The scheduler keeps which requests are in flight; the queue keeps the batches and
numbers the steps (`next_step_no`, the number `Scheduler.schedule` is given).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Protocol

from vllm.core.scheduler import SchedulerOutputs
from vllm.distributed.serialization import MessageNotSerializableError, message_bytes
from vllm.executor.step_future import StepFuture
from vllm.sequence import SamplerOutput, SequenceStatus
from vllm.step_records import BlockOps, ExecuteModelRequest, RequestRecord, StepMessage


class StepExecutor(Protocol):
    """What the queue needs of an executor."""

    def execute_model(
        self, request: ExecuteModelRequest, non_block: Literal[True], num_tokens: int = 0
    ) -> StepFuture: ...

    def discard_steps(self) -> None: ...


@dataclass
class InFlightBatch:
    """One submitted micro-batch: its future and what the scheduler decided."""

    future: StepFuture
    scheduler_outputs: SchedulerOutputs
    step_no: int
    submitted_at: float = 0.0  # perf_counter()


@dataclass
class BatchQueueStats:
    """Counters since the last reset. Bytes are counted only with `count_bytes` on: the
    pickled step message, and what the same step would take with every request in full
    (token histories and sampling params)."""

    steps: int = 0
    step_bytes: int = 0
    full_bytes: int = 0
    ahead_groups: int = 0
    groups: int = 0
    per_step_bytes: list[int] = field(default_factory=list)


class BatchQueue:
    """Submits scheduled batches and hands their outputs back oldest first."""

    def __init__(self, executor: StepExecutor, pipeline_depth: int, async_pipeline: bool) -> None:
        self.executor = executor
        self.async_pipeline = async_pipeline
        self.pipeline_depth = pipeline_depth
        self.max_concurrent_batches = pipeline_depth * (2 if async_pipeline else 1)
        self._batches: deque[InFlightBatch] = deque()
        # The one numbering of steps: the scheduler's flights and scheduling ahead, and the
        # channel of sampled ids (restarts at 0 with new groups).
        self._step_no = 0
        # Steps whose output was collected (so their sampled ids were sent), and a floor set
        # after an interrupt: every abandoned step's ids must be drained first.
        self._collected_through = 0
        self._drain_through = 0
        self.count_bytes = False
        self.stats = BatchQueueStats()
        # Batches whose submission raised (see unsent_block_ops).
        self._failed_submits: list[SchedulerOutputs] = []
        # When the last output was collected, and how long the pipeline's slowest stage took
        # over the batch collected last (None when that cannot be told: see collect_oldest).
        self._collected_at = 0.0
        self.last_step_s: float | None = None

    def __len__(self) -> int:
        return len(self._batches)

    def is_full(self) -> bool:
        return len(self._batches) >= self.max_concurrent_batches

    @property
    def next_step_no(self) -> int:
        """The number the next submitted step gets: the scheduler schedules it under this
        number (`Scheduler.schedule`), so both name a step alike."""
        return self._step_no + 1

    def submit(
        self,
        scheduler_outputs: SchedulerOutputs,
        records: list[RequestRecord],
        finished_request_ids: list[str],
        kv_blocks_bound: int,
    ) -> None:
        """Submit one scheduled batch (its records, as the scheduler wrote them).

        A step that cannot be serialised for the stages (MessageNotSerializableError from the
        executor, raised before anything is sent) leaves the queue and its step numbers as
        they were, and is re-raised for the engine to handle; the scheduler commits what the
        records told the stages only once this returns (`Scheduler.commit_step`)."""
        if scheduler_outputs.step_no != self.next_step_no:
            raise RuntimeError(
                f"batch scheduled as step {scheduler_outputs.step_no}, submitted as step "
                f"{self.next_step_no}"
            )
        written = scheduler_outputs.written
        message = StepMessage(
            records, scheduler_outputs.step_no, reset=written is not None and written.reset
        )
        if self.async_pipeline:
            message.send_sampled = True
            # The first stage drains the sampled ids of every step collected so far (they
            # were sent), and of the steps abandoned by an interrupt.
            message.recv_sampled_through = max(self._collected_through, self._drain_through)
        # The steps in flight whose sampled ids the decodes scheduled ahead feed.
        message.recv_sampled_through = max(
            [message.recv_sampled_through, *scheduler_outputs.ahead.values()]
        )
        request = ExecuteModelRequest(
            step=message,
            blocks_to_swap_in=scheduler_outputs.blocks_to_swap_in,
            blocks_to_swap_out=scheduler_outputs.blocks_to_swap_out,
            blocks_to_copy=scheduler_outputs.blocks_to_copy,
            finished_request_ids=finished_request_ids,
            kv_blocks_bound=kv_blocks_bound,
        )
        # Counted before it is sent: a step that failed half-way still numbers the channel.
        self._step_no = scheduler_outputs.step_no
        try:
            future = self.executor.execute_model(
                request, non_block=True, num_tokens=scheduler_outputs.num_batched_tokens
            )
        except MessageNotSerializableError:
            self._step_no -= 1  # nothing was sent
            raise
        except BaseException:
            # Sent to no rank: its block operations are applied before a stage-local rebuild.
            self._failed_submits.append(scheduler_outputs)
            raise
        if self.count_bytes:
            self._count(message, scheduler_outputs)
        self.stats.steps += 1
        self.stats.groups += len(records)
        self.stats.ahead_groups += len(scheduler_outputs.ahead)
        self._batches.append(
            InFlightBatch(future, scheduler_outputs, self._step_no, time.perf_counter())
        )

    def request_ids_of_call(self, call_id: int | None) -> list[str]:
        """The requests of the in-flight step that the executor submitted as call `call_id`
        (`StepFuture.call_id`); [] when none is in flight."""
        for batch in self._batches:
            if call_id is not None and batch.future.call_id == call_id:
                return [g.request_id for g in batch.scheduler_outputs.scheduled_seq_groups]
        return []

    def _count(self, message: StepMessage, scheduler_outputs: SchedulerOutputs) -> None:
        size = message_bytes(message)
        self.stats.step_bytes += size
        self.stats.per_step_bytes.append(size)
        running = SequenceStatus.RUNNING
        full = [
            (group.request_id, group.sampling_params, [s.data for s in group.get_seqs(running)])
            for group in scheduler_outputs.scheduled_seq_groups
        ]
        self.stats.full_bytes += message_bytes(full)

    def collect_oldest(self) -> tuple[SchedulerOutputs, SamplerOutput]:
        """Wait for the oldest batch; it leaves the queue only once its output is here (a
        failure while waiting leaves it for `discard` or `reset`).

        Sets `last_step_s`: with one stage, the time from the batch's submission; with
        several, the time since the previous output when the batch was submitted before it
        (the pipeline was busy: outputs then leave at the pace of the slowest stage), else
        None (the batch ran through an idle pipeline: that time is every stage's, not one's)."""
        batch = self._batches[0]
        output = batch.future.result()
        now = time.perf_counter()
        self._batches.popleft()
        if self.pipeline_depth == 1:
            self.last_step_s = now - max(batch.submitted_at, self._collected_at)
        elif batch.submitted_at < self._collected_at:
            self.last_step_s = now - self._collected_at
        else:
            self.last_step_s = None
        self._collected_at = now
        self._collected_through = batch.step_no
        return batch.scheduler_outputs, output

    def discard(self) -> None:
        """An interrupt: forget the batches in flight. The stages still run them, in order,
        before anything later; the first stage drains the abandoned steps' sampled ids first
        (the scheduler's re-queue makes the next step tell the stages to forget every
        request: `StepWriter.forget_all`)."""
        self._batches.clear()
        self._failed_submits.clear()
        self.executor.discard_steps()
        self._drain_through = self._step_no

    def unsent_block_ops(self) -> list[BlockOps]:
        """The block operations of batches whose submission raised, in order. A step is sent
        to every rank or to none (`RankCalls.submit`), so no rank applied them, while the
        scheduler's block tables already say they happened: a stage-local rebuild applies
        them first. (Every surviving rank applied those of the batches that were sent, failed
        or not: `Worker.execute_model`.)"""
        return [
            BlockOps(out.blocks_to_swap_in, out.blocks_to_swap_out, out.blocks_to_copy)
            for out in self._failed_submits
        ]

    def reset(self) -> None:
        """A stage was replaced and the groups re-formed: nothing is in flight, the stages
        hold no request, and the sampled-id channel starts again."""
        self._batches.clear()
        self._failed_submits.clear()
        self._step_no = self._collected_through = self._drain_through = 0

    def configure(self, pipeline_depth: int, async_pipeline: bool) -> None:
        """The pipeline changed size (a shrink or grow): its depth and whether decodes
        are scheduled ahead; the groups were re-formed, so the queue starts again (`reset`)."""
        self.reset()
        self.async_pipeline = async_pipeline
        self.pipeline_depth = pipeline_depth
        self.max_concurrent_batches = pipeline_depth * (2 if async_pipeline else 1)

    def reset_stats(self) -> BatchQueueStats:
        stats, self.stats = self.stats, BatchQueueStats()
        return stats
