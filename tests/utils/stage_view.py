"""A first/last stage's view of a scheduler's steps, for tests that read what a step runs.

The scheduler writes each step once as records (`NewRequestData` / `CachedRequestData`); the
stages rebuild the rows the model runner reads in their `RequestTable`. `schedule_rows` does
both, as the engine and a stage would: schedule, commit (the step was sent), apply the records
to the scheduler's own table, and return the rows in the scheduler's order. Every step of a
scheduler must go through it (a table that missed a step fails loudly, as a stage would).
"""

from __future__ import annotations

import weakref

from vllm.core.scheduler import Scheduler, SchedulerOutputs
from vllm.sequence import SequenceGroupMetadata
from vllm.step_records import CachedSeqData, StepMessage
from vllm.worker.request_table import RequestTable

# The token the view feeds a decode scheduled ahead (a real stage feeds the id its previous
# step sampled, which no scheduler test has).
PENDING_TOKEN = -1

_tables: weakref.WeakKeyDictionary[Scheduler, RequestTable] = weakref.WeakKeyDictionary()


def schedule_rows(
    scheduler: Scheduler, step_no: int = 0
) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
    """`scheduler.schedule(step_no)`, committed and applied to the scheduler's stage table:
    (the step's rows in the scheduler's order, the scheduler's outputs)."""
    table = _tables.setdefault(scheduler, RequestTable())
    records, out = scheduler.schedule(step_no)
    if out.is_empty():
        return [], out
    scheduler.commit_step(out)
    for record in records:
        for seq in record.seqs:
            if isinstance(seq, CachedSeqData) and seq.num_pending:
                table.record_sampled([(seq.seq_id, PENDING_TOKEN)])
    reset = out.written is not None and out.written.reset
    return table.apply(StepMessage(records, step_no, reset=reset)).groups, out
