"""Scheduler: budgets, FCFS, ignored prompts, preemption, swapping, in-flight groups, abort."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tests.utils.fake_requests import FakeParams as _Params
from tests.utils.fake_requests import seq_ids as _seq_ids
from tests.utils.stage_view import schedule_rows
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.budget import NO_CAP, MicroBatchBudget
from vllm.core.scheduler import PreemptionMode, Scheduler
from vllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus

# Torch-free unit tests: part of `make test-fast`.
pytestmark = pytest.mark.fast

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scheduler(
    gpu: int = 16,
    cpu: int = 0,
    max_num_seqs: int = 8,
    max_tokens: int = 64,
    max_model_len: int = 64,
    preemption_mode: str | None = None,
    cohorts: int = 1,
) -> Scheduler:
    cache = CacheConfig(block_size=4, num_gpu_blocks=gpu, num_cpu_blocks=cpu)
    config = SchedulerConfig(
        max_num_batched_tokens=max_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        preemption_mode=preemption_mode,
    )
    return Scheduler(config, cache, MicroBatchBudget.from_config(config, cohorts))


def _add(
    sched: Scheduler, request_id: str, prompt_len: int, best_of: int = 1, arrival: float = 0.0
) -> SequenceGroup:
    seq = Sequence(next(_seq_ids), "p", list(range(prompt_len)), block_size=4)
    group = SequenceGroup(request_id, [seq], _Params(best_of, best_of), arrival_time=arrival)
    sched.add_seq_group(group)
    return group


def _ids(groups: list[SequenceGroup]) -> list[str]:
    return [g.request_id for g in groups]


def _complete(sched: Scheduler, groups: list[SequenceGroup]) -> None:
    """What the engine does when a batch leaves the pipeline: one new token per running seq."""
    sched.finish_in_flight(_ids(groups))
    for group in groups:
        for seq in group.get_seqs(status=SequenceStatus.RUNNING):
            seq.append_token_id(7, {7: Logprob(0.0)})


def _finish(sched: Scheduler, group: SequenceGroup) -> None:
    for seq in group.get_seqs():
        seq.status = SequenceStatus.FINISHED_STOPPED
        sched.free_seq(seq)
    sched.free_finished_seq_groups()


def test_no_torch_imported() -> None:
    code = (
        "import sys, vllm.core.scheduler, vllm.core.block_manager, vllm.sequence\n"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    env = dict(os.environ, PYTHONPATH=_REPO)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def test_token_budget_fcfs_and_metadata() -> None:
    sched = _scheduler(max_tokens=16, max_model_len=16)
    a, b, c = (_add(sched, rid, 6) for rid in "abc")
    metadata, out = schedule_rows(sched)
    assert out.prompt_run and _ids(out.scheduled_seq_groups) == ["a", "b"]  # 18 > 16 for c
    assert out.num_batched_tokens == 12
    assert [m.request_id for m in metadata] == ["a", "b"]
    seq_a = a.get_seqs()[0]
    assert metadata[0].is_prompt
    assert metadata[0].seq_data == {seq_a.seq_id: seq_a.data}
    assert metadata[0].block_tables == {seq_a.seq_id: [0, 1]}
    assert metadata[1].block_tables == {b.get_seqs()[0].seq_id: [2, 3]}
    assert seq_a.status == SequenceStatus.RUNNING
    assert set(sched.in_flight) == {"a", "b"}

    # While a and b are in the pipeline, the next batch gets the other request.
    _, out = schedule_rows(sched)
    assert out.prompt_run and _ids(out.scheduled_seq_groups) == ["c"]
    _, out = schedule_rows(sched)
    assert out.is_empty() and not out.prompt_run

    _complete(sched, [a, b, c])
    metadata, out = schedule_rows(sched)
    assert not out.prompt_run and _ids(out.scheduled_seq_groups) == ["a", "b", "c"]
    assert out.num_batched_tokens == 3
    assert not metadata[0].is_prompt
    assert metadata[2].block_tables == {c.get_seqs()[0].seq_id: [4, 5]}


def test_seq_budget_counts_running_and_best_of() -> None:
    sched = _scheduler(max_num_seqs=3)
    _add(sched, "a", 4, best_of=2)
    _add(sched, "b", 4, best_of=2)
    _add(sched, "c", 4)
    _, out = schedule_rows(sched)
    assert _ids(out.scheduled_seq_groups) == ["a"]  # a would fork into 2, 2 + 2 > 3
    # FCFS: c fits the budget but must not overtake b.
    _, out = schedule_rows(sched)
    assert out.is_empty()
    assert _ids(sched.waiting) == ["b", "c"]
    assert sched.get_num_unfinished_seq_groups() == 3


def test_ignored_long_prompt_alongside_normal(caplog: pytest.LogCaptureFixture) -> None:
    sched = _scheduler(gpu=2, max_tokens=16, max_model_len=16)
    long = _add(sched, "long", 20)
    huge = _add(sched, "huge", 12)  # 3 blocks: more than the whole cache
    ok = _add(sched, "ok", 5)
    with caplog.at_level(logging.WARNING, logger="vllm.core.scheduler"):
        metadata, out = schedule_rows(sched)
    assert out.prompt_run
    assert _ids(out.ignored_seq_groups) == ["long", "huge"]
    assert _ids(out.scheduled_seq_groups) == ["ok"] == [m.request_id for m in metadata]
    assert long.get_seqs()[0].status == SequenceStatus.FINISHED_IGNORED
    assert huge.get_seqs()[0].status == SequenceStatus.FINISHED_IGNORED
    assert ok.get_seqs()[0].status == SequenceStatus.RUNNING
    assert "Input prompt (20 tokens) is too long and exceeds limit of 16" in caplog.text
    assert "(12 tokens) is too long and exceeds the capacity of block_manager" in caplog.text
    assert not sched.waiting and set(sched.in_flight) == {"ok"}


def test_recompute_preemption_victim_is_last_and_reprefills() -> None:
    sched = _scheduler(gpu=3, max_num_seqs=4)
    a, b, c = (_add(sched, rid, 4) for rid in "abc")
    _, out = schedule_rows(sched)
    assert _ids(out.scheduled_seq_groups) == ["a", "b", "c"]
    _complete(sched, [a, b, c])  # each now has 5 tokens: needs a second block, none is free
    _add(sched, "d", 8)  # 2 blocks: LATER, so this step decodes

    _, out = schedule_rows(sched)
    assert not out.prompt_run
    assert _ids(out.scheduled_seq_groups) == ["a"]
    # a evicts the last group (c); b then finds nothing left to evict and preempts itself.
    assert out.num_preempted == 2 and sched.num_cumulative_preemption == 2
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 1)
    assert _ids(sched.waiting) == ["b", "c", "d"]  # victims go to the front, in FCFS order
    assert c.get_seqs()[0].status == SequenceStatus.WAITING
    assert sched.block_manager.get_block_table(a.get_seqs()[0]) == [0, 2]
    assert not out.blocks_to_swap_out and not out.blocks_to_copy

    _complete(sched, [a])
    _finish(sched, a)
    metadata, out = schedule_rows(sched)
    assert out.prompt_run and _ids(out.scheduled_seq_groups) == ["b"]  # c (2 blocks) waits
    assert out.num_batched_tokens == 5  # prompt plus the token generated before preemption
    assert metadata[0].seq_data[b.get_seqs()[0].seq_id].get_len() == 5
    assert metadata[0].block_tables == {b.get_seqs()[0].seq_id: [0, 1]}
    assert _ids(sched.waiting) == ["c", "d"]


def test_forced_swap_preemption_then_swap_in() -> None:
    sched = _scheduler(gpu=4, cpu=4, max_num_seqs=4, preemption_mode="swap")
    a, b, c = (_add(sched, rid, 4) for rid in "abc")
    _, out = schedule_rows(sched)
    _complete(sched, [a, b, c])
    _, out = schedule_rows(sched)
    assert _ids(out.scheduled_seq_groups) == ["a", "b"]
    assert out.blocks_to_swap_out == {2: 0}
    assert _ids(sched.swapped) == ["c"]
    assert c.get_seqs()[0].status == SequenceStatus.SWAPPED
    assert sched.block_manager.get_num_free_cpu_blocks() == 3

    _complete(sched, [a, b])
    _finish(sched, a)  # releases gpu blocks 0 and 3
    # Swapped groups block new prompts, like vLLM V0.
    _add(sched, "e", 4)
    metadata, out = schedule_rows(sched)
    assert not out.prompt_run
    assert _ids(out.scheduled_seq_groups) == ["b", "c"]
    assert out.blocks_to_swap_in == {0: 0}
    assert out.num_preempted == 0
    assert metadata[1].block_tables == {c.get_seqs()[0].seq_id: [0, 3]}
    assert c.get_seqs()[0].status == SequenceStatus.RUNNING
    assert not sched.swapped and sched.block_manager.get_num_free_cpu_blocks() == 4


def test_no_swap_in_during_a_step_that_preempted() -> None:
    sched = _scheduler(gpu=6, cpu=8, preemption_mode="swap")
    a = _add(sched, "a", 4, arrival=0.0)
    s = _add(sched, "s", 4, arrival=1.0)
    big = _add(sched, "big", 16, arrival=2.0)
    schedule_rows(sched)  # a [0], s [1], big [2, 3, 4, 5]
    _complete(sched, [a, s])  # big stays in flight, so s is the only possible victim
    _, out = schedule_rows(sched)
    assert _ids(out.scheduled_seq_groups) == ["a"] and out.blocks_to_swap_out == {1: 0}
    _complete(sched, [a, big])
    _, out = schedule_rows(sched)  # a must evict big; 4 blocks free up, yet s stays out
    assert _ids(out.scheduled_seq_groups) == ["a"] and out.num_preempted == 1
    assert out.blocks_to_swap_out == {2: 1, 3: 2, 4: 3, 5: 4} and not out.blocks_to_swap_in
    assert _ids(sched.swapped) == ["s", "big"]
    _complete(sched, [a])
    _, out = schedule_rows(sched)
    assert _ids(out.scheduled_seq_groups) == ["a", "s"] and out.blocks_to_swap_in == {0: 2}
    assert sched.block_manager.get_block_table(s.get_seqs()[0]) == [2, 3]
    assert _ids(sched.swapped) == ["big"]  # 4 blocks + 1 > 2 free


def test_lack_of_swap_space_raises() -> None:
    sched = _scheduler(gpu=4, cpu=0, preemption_mode="swap")
    groups = [_add(sched, rid, 4) for rid in "abc"]
    schedule_rows(sched)
    _complete(sched, groups)
    with pytest.raises(RuntimeError, match="Aborted due to the lack of CPU swap space"):
        schedule_rows(sched)


def test_default_preemption_mode_rule() -> None:
    sched = _scheduler()
    single = _add(sched, "single", 4)
    assert sched._preemption_mode(single) == PreemptionMode.RECOMPUTE
    sampled = _add(sched, "sampled", 4, best_of=2)
    assert sched._preemption_mode(sampled) == PreemptionMode.SWAP


def test_copy_on_write_pairs_reach_blocks_to_copy() -> None:
    sched = _scheduler(gpu=8)
    group = _add(sched, "a", 3, best_of=2)
    schedule_rows(sched)
    _complete(sched, [group])  # 4 tokens: block 0 is full, then shared by the fork
    parent = group.get_seqs()[0]
    child = parent.fork(next(_seq_ids))
    group.add(child)
    sched.fork_seq(parent, child)
    metadata, out = schedule_rows(sched)
    assert out.blocks_to_copy == {0: [1]}
    assert metadata[0].block_tables == {parent.seq_id: [1], child.seq_id: [0]}
    assert out.num_batched_tokens == 2


def test_in_flight_group_is_never_preempted() -> None:
    sched = _scheduler(gpu=6, max_tokens=16, max_model_len=16)
    a = _add(sched, "a", 12)  # 3 blocks each; 12 + 12 tokens exceed one batch
    b = _add(sched, "b", 12)
    assert _ids(schedule_rows(sched)[1].scheduled_seq_groups) == ["a"]
    assert _ids(schedule_rows(sched)[1].scheduled_seq_groups) == ["b"]
    _complete(sched, [a])
    _, out = schedule_rows(sched)  # a needs a 4th block, none is free, b is in flight
    assert out.scheduled_seq_groups == [] and out.num_preempted == 1
    assert _ids(sched.waiting) == ["a"] and _ids(sched.running) == ["b"]
    assert a.num_preemptions == 1 and b.num_preemptions == 0
    assert b.get_seqs()[0].status == SequenceStatus.RUNNING
    assert sched.block_manager.get_block_table(b.get_seqs()[0]) == [3, 4, 5]
    assert set(sched.in_flight) == {"b"}

    _complete(sched, [b])
    _, out = schedule_rows(sched)  # a (13 tokens) waits for 4 blocks; b decodes into block 0
    assert not out.prompt_run and _ids(out.scheduled_seq_groups) == ["b"]
    assert sched.block_manager.get_block_table(b.get_seqs()[0]) == [3, 4, 5, 0]
    assert _ids(sched.waiting) == ["a"]


def test_abort_waiting_running_and_in_flight() -> None:
    sched = _scheduler(gpu=8, max_num_seqs=2)
    a, b, c = (_add(sched, rid, 4) for rid in "abc")
    _, out = schedule_rows(sched)
    assert _ids(out.scheduled_seq_groups) == ["a", "b"]
    _complete(sched, [b])
    assert sched.block_manager.get_num_free_gpu_blocks() == 6

    sched.abort_seq_group("c")  # waiting
    assert not sched.waiting
    assert c.get_seqs()[0].status == SequenceStatus.FINISHED_ABORTED
    sched.abort_seq_group(["b", "unknown"])  # running, not in flight: freed at once
    assert b.get_seqs()[0].status == SequenceStatus.FINISHED_ABORTED
    assert sched.block_manager.get_num_free_gpu_blocks() == 7
    sched.abort_seq_group("a")  # in flight: its blocks may still be written
    assert a.get_seqs()[0].status == SequenceStatus.FINISHED_ABORTED
    assert not sched.running and set(sched.in_flight) == {"a"}
    assert sched.block_manager.get_num_free_gpu_blocks() == 7
    assert not sched.has_unfinished_seqs()
    sched.finish_in_flight(["a"])
    assert sched.block_manager.get_num_free_gpu_blocks() == 8
    assert not sched.in_flight
    sched.abort_seq_group("a")  # already gone: no-op
    assert schedule_rows(sched)[1].is_empty()


def test_free_finished_seq_groups_keeps_unfinished() -> None:
    sched = _scheduler()
    a, b = _add(sched, "a", 4), _add(sched, "b", 4)
    schedule_rows(sched)
    _complete(sched, [a, b])
    _finish(sched, a)
    assert _ids(sched.running) == ["b"]
    assert sched.block_manager.get_num_free_gpu_blocks() == 15
    assert sched.has_unfinished_seqs() and sched.get_num_unfinished_seq_groups() == 1


def test_micro_batch_cap_splits_prompts_and_decodes() -> None:
    sched = _scheduler(gpu=64, max_num_seqs=8, max_tokens=64, cohorts=3)
    for i in range(6):
        _add(sched, f"r{i}", 4, arrival=float(i))
    assert sched.num_active_seqs() == 6
    # Three cohorts: each micro-batch takes at most a third of the active sequences.
    batches = [schedule_rows(sched)[1] for _ in range(3)]
    assert [_ids(b.scheduled_seq_groups) for b in batches] == [
        ["r0", "r1"],
        ["r2", "r3"],
        ["r4", "r5"],
    ]
    assert schedule_rows(sched)[1].is_empty()  # everything is in flight
    _complete(sched, batches[0].scheduled_seq_groups + batches[1].scheduled_seq_groups)
    _, decode = schedule_rows(sched)
    assert not decode.prompt_run and _ids(decode.scheduled_seq_groups) == ["r0", "r1"]
    _, decode = schedule_rows(sched)
    assert _ids(decode.scheduled_seq_groups) == ["r2", "r3"]


def test_a_group_larger_than_the_cap_runs_alone() -> None:
    sched = _scheduler(gpu=64, max_num_seqs=8, max_tokens=64, cohorts=4)
    _add(sched, "big", 4, best_of=3, arrival=0.0)
    _add(sched, "small", 4, arrival=1.0)
    # 2 active sequences over 4 cohorts: a cap of 1, yet the first group always fits.
    assert sched.budget.max_batch_seqs(sched.num_active_seqs()) == 1
    _, first = schedule_rows(sched)
    assert _ids(first.scheduled_seq_groups) == ["big"]
    _, second = schedule_rows(sched)
    assert _ids(second.scheduled_seq_groups) == ["small"]


def test_budget_splits_sequences_and_tokens_by_cohorts() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    one = MicroBatchBudget.from_config(config)
    assert (one.cohorts, one.max_num_seqs, one.max_num_batched_tokens) == (1, 8, 64)
    assert one.max_batch_seqs(100) == NO_CAP
    assert one.token_budget(10, 500) == (64, 64)
    three = MicroBatchBudget.from_config(config, 3)
    assert [three.max_batch_seqs(n) for n in (0, 1, 3, 4, 7)] == [1, 1, 1, 2, 3]
    # ceil(10 / 3) decode tokens + ceil(min(500, 64) / 3) prefill tokens per micro-batch.
    assert three.token_budget(10, 500) == (4 + 22, 4)
    assert three.token_budget(0, 0) == (1, 1)
    with pytest.raises(ValueError, match="cohorts"):
        MicroBatchBudget(0, 8, 64)


def test_kv_blocks_bound_covers_every_admitted_sequence_at_its_longest():
    sched = _scheduler(gpu=64, max_model_len=40)
    assert sched.kv_blocks_bound() == 0
    _add(sched, "a", 6)  # 6 + 16 tokens -> 6 blocks of 4
    _add(sched, "b", 30)  # 30 + 16 capped at 40 -> 10 blocks
    group = _add(sched, "c", 3, best_of=2)  # forks into 2 sequences of 3 + 16 -> 2 x 5
    group.sampling_params.max_tokens = None  # up to max_model_len: 2 x 10 blocks
    schedule_rows(sched)
    assert sched.kv_blocks_bound() == 6 + 10 + 20
    # Decode steps do not move it; it never exceeds the cache.
    for g in sched.running:
        sched.finish_in_flight([g.request_id])
    schedule_rows(sched)
    assert sched.kv_blocks_bound() == 36
    small = _scheduler(gpu=8)
    _add(small, "x", 20)
    schedule_rows(small)
    assert small.kv_blocks_bound() == 8
