"""The step records the scheduler writes once, and the stage's request table (torch-free).

A request reaches the stages once in full (`NewRequestData`), then as what changed
(`CachedRequestData`): new tokens, new blocks appended, or the whole table when the block
manager rewrote an entry. What the stages hold lives on the request and changes only when the
step is committed. Each case applies the records to a `RequestTable`, as the first and last
stages do, and checks the rows it rebuilds against the engine's sequences and tables.
"""

from __future__ import annotations

import pickle

import pytest

from tests.utils.fake_requests import FakeParams
from tests.utils.fake_requests import seq_ids as _seq_ids
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.budget import MicroBatchBudget
from vllm.core.scheduler import Scheduler, SchedulerOutputs
from vllm.sequence import Logprob, Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus
from vllm.step_records import (
    CachedRequestData,
    CachedSeqData,
    NewRequestData,
    NewSeqData,
    RequestRecord,
    StepMessage,
)
from vllm.worker.request_table import RequestTable, StepRows

pytestmark = pytest.mark.fast


def _scheduler(gpu_blocks: int = 256, cpu_blocks: int = 0, ahead: bool = False) -> Scheduler:
    cache = CacheConfig(block_size=4, num_gpu_blocks=gpu_blocks, num_cpu_blocks=cpu_blocks)
    config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=32, max_model_len=512)
    budget = MicroBatchBudget.from_config(config)
    return Scheduler(config, cache, budget, schedule_ahead=ahead)


def _add(sched: Scheduler, request_id: str, prompt_len: int, **params) -> SequenceGroup:
    seq = Sequence(next(_seq_ids), "p", [(i * 7) % 50 + 3 for i in range(prompt_len)], 4)
    group = SequenceGroup(request_id, [seq], FakeParams(**params), arrival_time=0.0)  # type: ignore[arg-type]
    sched.add_seq_group(group)
    return group


def _step(
    sched: Scheduler, table: RequestTable, step_no: int = 0, commit: bool = True
) -> tuple[list[RequestRecord], SchedulerOutputs, StepRows]:
    """Schedule, commit (the step was sent) and apply to the stage's table."""
    records, out = sched.schedule(step_no)
    if commit:
        sched.commit_step(out)
    reset = out.written is not None and out.written.reset
    rows = table.apply(StepMessage(records, step_no, reset=reset))
    return records, out, rows


def _return(sched: Scheduler, out: SchedulerOutputs, token: int = 9) -> None:
    """The batch came back: every running sequence of a decoding group gets `token`."""
    groups = out.scheduled_seq_groups
    sched.finish_in_flight([g.request_id for g in groups])
    for group in groups:
        if group.is_prefill():
            continue
        for seq in group.get_seqs(status=SequenceStatus.RUNNING):
            seq.append_token_id(token, {token: Logprob(-0.5)})


def _check_rows(sched: Scheduler, rows: StepRows, out: SchedulerOutputs) -> None:
    """The stage's rows hold exactly the engine's tokens, counts and block tables."""
    assert [m.request_id for m in rows.groups] == [g.request_id for g in out.scheduled_seq_groups]
    for meta, group in zip(rows.groups, out.scheduled_seq_groups):
        running = group.get_seqs(status=SequenceStatus.RUNNING)
        assert list(meta.seq_data) == [s.seq_id for s in running]
        for seq in running:
            data = meta.seq_data[seq.seq_id]
            assert data.get_token_ids() == seq.get_token_ids()
            assert data.get_num_computed_tokens() == seq.data.get_num_computed_tokens()
            assert data.cumulative_logprob == seq.data.cumulative_logprob
            table = sched.block_manager.get_block_table(seq)
            assert meta.block_tables[seq.seq_id] == table


def test_new_once_then_small_cached_records() -> None:
    sched, table = _scheduler(), RequestTable()
    groups = [_add(sched, f"g{i}", 60) for i in range(8)]
    records, out, rows = _step(sched, table)
    assert all(isinstance(r, NewRequestData) for r in records)
    _check_rows(sched, rows, out)
    _return(sched, out)
    for _ in range(5):  # decodes; a block boundary is crossed on the way (60 -> 65 tokens)
        records, out, rows = _step(sched, table)
        assert all(isinstance(r, CachedRequestData) for r in records)
        for record in records:
            (seq,) = record.seqs
            assert isinstance(seq, CachedSeqData)
            assert seq.new_token_ids == (9,) and not seq.whole_table and seq.num_pending == 0
            assert len(seq.new_block_ids) <= 1
        _check_rows(sched, rows, out)
        _return(sched, out)
    full = [
        SequenceGroupMetadata(
            g.request_id, False, {s.seq_id: s.data for s in g.get_seqs()}, g.sampling_params,
            {s.seq_id: sched.block_manager.get_block_table(s) for s in g.get_seqs()},
        )
        for g in groups
    ]  # fmt: skip
    assert len(pickle.dumps(records)) * 5 < len(pickle.dumps(full))


def test_a_step_not_committed_changes_nothing() -> None:
    """The all-or-nothing step: until the executor accepted it, what the stages hold (on the
    requests) is untouched, so writing again gives the same records."""
    sched = _scheduler()
    group = _add(sched, "a", 10)
    _, out = sched.schedule()
    assert group.held_generation == -1 and group.get_seqs()[0].held is None
    again = sched.step_writer.write(out.scheduled_seq_groups, out.token_chunk_sizes, out.ahead)
    assert out.written is not None and again.records == out.written.records
    sched.commit_step(out)
    seq = group.get_seqs()[0]
    assert group.held_generation == sched.step_writer.generation
    assert seq.held is not None and seq.held.num_tokens == 10 and seq.held.num_blocks == 3


def test_copy_on_write_sends_the_whole_table_and_a_fork_in_full() -> None:
    sched, table = _scheduler(), RequestTable()
    group = _add(sched, "b", 6, n=2, best_of=2)
    _, out, _ = _step(sched, table)
    _return(sched, out)
    parent = group.get_seqs()[0]
    child = parent.fork_light(next(_seq_ids))
    group.add(child)
    sched.fork_seq(parent, child)  # they share every block; the next write copies the last
    records, out, rows = _step(sched, table)
    (record,) = records
    assert isinstance(record, CachedRequestData)
    kinds = {seq.seq_id: seq for seq in record.seqs}
    assert isinstance(kinds[child.seq_id], NewSeqData)
    held = kinds[parent.seq_id]
    assert isinstance(held, CachedSeqData)
    # Both end inside their shared last block (7 tokens): the parent, written first, gets a
    # private copy of it, so its table changed other than by appending.
    assert out.blocks_to_copy
    assert held.whole_table
    assert held.new_block_ids == tuple(sched.block_manager.get_block_table(parent))
    _check_rows(sched, rows, out)
    # The next step appends again: a tail (nothing new inside the same block).
    _return(sched, out)
    records, out, rows = _step(sched, table)
    assert all(isinstance(s, CachedSeqData) and not s.whole_table for s in records[0].seqs)
    _check_rows(sched, rows, out)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_resumed_request_is_sent_in_full(mode: str) -> None:
    """A preempted group's stage copy is stale (its KV and table start over): the stages get
    it in full when it runs again, and deltas after that."""
    swap = 16 if mode == "swap" else 0
    sched, table = _scheduler(gpu_blocks=6, cpu_blocks=swap), RequestTable()
    sched.scheduler_config.preemption_mode = mode
    groups = {rid: _add(sched, rid, 8, max_tokens=12) for rid in ("a", "b")}
    last_seen: dict[str, int] = {}
    resumed = cached = 0
    for _ in range(40):
        if not sched.has_unfinished_seqs():
            break
        records, out, rows = _step(sched, table)
        for group in groups.values():
            if group.num_preemptions and not group.is_in_flight() and not group.is_finished():
                assert group.held_generation == -1  # preempted, not resumed yet
        for record in records:
            group = groups[record.request_id]
            if group.num_preemptions > last_seen.get(record.request_id, 0):
                assert isinstance(record, NewRequestData), record
                resumed += 1
            elif isinstance(record, CachedRequestData):
                cached += 1
            last_seen[record.request_id] = group.num_preemptions
        _check_rows(sched, rows, out)
        _return(sched, out)
        for group in groups.values():
            for seq in group.get_seqs(status=SequenceStatus.RUNNING):
                if seq.get_output_len() >= 12:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                    sched.free_seq(seq)
        sched.free_finished_seq_groups()
    assert resumed > 0 and cached > 0


def test_reset_after_requeue_sends_everything_again() -> None:
    sched, table = _scheduler(), RequestTable()
    _add(sched, "a", 5)
    _add(sched, "b", 5)
    _, out, _ = _step(sched, table)
    _return(sched, out)
    assert table.num_requests() == 2
    _, out, _ = _step(sched, table)
    sched.requeue_in_flight()  # an interrupt: the stages forget every request
    records, out, rows = _step(sched, table)
    assert out.written is not None and out.written.reset
    assert all(isinstance(r, NewRequestData) for r in records)
    _check_rows(sched, rows, out)
    _return(sched, out)
    records, out, _ = _step(sched, table)
    assert out.written is not None and not out.written.reset  # said once, once it was sent
    assert all(isinstance(r, CachedRequestData) for r in records)


def test_a_stage_out_of_step_fails_loudly_naming_the_request() -> None:
    sched, table = _scheduler(), RequestTable()
    _add(sched, "a", 5)
    _add(sched, "g3", 5)
    _, out, _ = _step(sched, table)
    _return(sched, out)
    table.drop(["g3"])
    with pytest.raises(RuntimeError, match="g3"):
        _step(sched, table)


def test_ahead_feeds_the_sampled_token() -> None:
    sched, table = _scheduler(ahead=True), RequestTable()
    sched.budget = MicroBatchBudget.from_config(sched.scheduler_config, cohorts=1)
    group = _add(sched, "a", 5, max_tokens=10)
    _, out1, _ = _step(sched, table, step_no=1)
    _return(sched, out1)
    _, out2, rows2 = _step(sched, table, step_no=2)  # a decode, in flight
    table.record_sampled([(group.get_seqs()[0].seq_id, 42)])  # what step 2 sampled
    records, out3, rows3 = _step(sched, table, step_no=3)
    assert out3.ahead == {"a": 2}
    (record,) = records
    (seq,) = record.seqs
    assert isinstance(seq, CachedSeqData) and seq.num_pending == 1 and seq.new_token_ids == ()
    tokens = rows3.groups[0].seq_data[seq.seq_id].get_token_ids()
    assert tokens[-1] == 42 and len(tokens) == group.get_seqs()[0].get_len() + 1
    _return(sched, out2, token=42)
    _return(sched, out3, token=43)
    records, out4, rows4 = _step(sched, table, step_no=4)
    (seq,) = records[0].seqs
    assert isinstance(seq, CachedSeqData) and seq.new_token_ids == (43,)
    _check_rows(sched, rows4, out4)
