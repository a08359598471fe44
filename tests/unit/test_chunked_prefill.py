"""Chunked prefill in the scheduler (no torch): chunks within the token budget, decodes first,
sampling only on the last chunk, in flight between chunks, micro-batches balanced by tokens;
and the config rules and CLI flags of both scheduler features."""

from __future__ import annotations

import argparse

import pytest

from tests.utils.fake_requests import FakeParams as _Params
from tests.utils.fake_requests import seq_ids as _seq_ids
from tests.utils.stage_view import schedule_rows
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.budget import MicroBatchBudget
from vllm.core.scheduler import Scheduler
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus

# Torch-free unit tests: part of `make test-fast`.
pytestmark = pytest.mark.fast


def _scheduler(
    budget: int, gpu: int = 64, pp: int = 1, caching: bool = False, pipeline_chunks: bool = True
) -> Scheduler:
    cache = CacheConfig(
        block_size=4, num_gpu_blocks=gpu, num_cpu_blocks=8, enable_prefix_caching=caching
    )
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=min(budget, 16),
        max_model_len=128,
        enable_chunked_prefill=True,
    )
    budget_ = MicroBatchBudget.from_config(config, cohorts=pp)
    return Scheduler(config, cache, budget_, pipeline_chunks=pipeline_chunks)


def _add(sched: Scheduler, rid: str, prompt_len: int, arrival: float = 0.0) -> SequenceGroup:
    seq = Sequence(next(_seq_ids), "p", list(range(prompt_len)), block_size=4)
    group = SequenceGroup(rid, [seq], _Params(), arrival_time=arrival)
    sched.add_seq_group(group)
    return group


def _return(sched: Scheduler, metadata) -> None:
    """The engine's side when a batch returns: out of flight, a token for sampled groups."""
    groups = [sched.in_flight[m.request_id] for m in metadata]
    sched.finish_in_flight([m.request_id for m in metadata])
    for meta, group in zip(metadata, groups):
        if meta.do_sample:
            # The engine's sequences (the rows are the stage's copies).
            for seq_id in meta.seq_data:
                group.find(seq_id).data.append_token_id(7, 0.0)


def test_long_prompt_is_prefilled_in_chunks_next_to_decodes() -> None:
    sched = _scheduler(budget=8)
    short = _add(sched, "short", 3, arrival=0.0)
    long = _add(sched, "long", 20, arrival=1.0)
    metadata, out = schedule_rows(sched)
    # Budget 8: short's prompt (3) and the first 5 tokens of long.
    assert [(m.request_id, m.token_chunk_size, m.do_sample) for m in metadata] == [
        ("short", 3, True),
        ("long", 5, False),
    ]
    assert out.num_batched_tokens == 8 and out.prompt_run
    assert set(sched.in_flight) == {"short", "long"}
    _, empty = schedule_rows(sched)  # both in flight: the next chunk waits for this one
    assert empty.is_empty()
    _return(sched, metadata)
    seq_long = long.get_seqs()[0]
    assert seq_long.data.get_num_computed_tokens() == 5 and long.is_prefill()
    assert not short.is_prefill()
    metadata, out = schedule_rows(sched)
    # Decodes first (1 token), then 7 more prompt tokens.
    assert [(m.request_id, m.is_prompt, m.token_chunk_size) for m in metadata] == [
        ("long", True, 7),
        ("short", False, 1),
    ]
    _return(sched, metadata)
    metadata, _ = schedule_rows(sched)
    assert [(m.request_id, m.token_chunk_size, m.do_sample) for m in metadata] == [
        ("long", 7, False),
        ("short", 1, True),
    ]
    _return(sched, metadata)
    metadata, _ = schedule_rows(sched)
    assert [(m.request_id, m.token_chunk_size, m.do_sample) for m in metadata] == [
        ("long", 1, True),
        ("short", 1, True),
    ]
    _return(sched, metadata)
    assert not long.is_prefill() and seq_long.get_output_len() == 1
    assert seq_long.data.get_num_computed_tokens() == 20
    metadata, _ = schedule_rows(sched)
    assert all(not m.is_prompt for m in metadata)


def test_recompute_preemption_restarts_a_partial_prefill() -> None:
    sched = _scheduler(budget=8, gpu=5)
    a = _add(sched, "a", 4, arrival=0.0)
    b = _add(sched, "b", 16, arrival=1.0)  # 1 + 4 blocks: the cache is full
    metadata, _ = schedule_rows(sched)
    assert [m.token_chunk_size for m in metadata] == [4, 4]
    _return(sched, metadata)
    seq_b = b.get_seqs()[0]
    assert seq_b.data.get_num_computed_tokens() == 4
    # a's fifth token needs a block: b (later, half prefilled) is the victim.
    metadata, out = schedule_rows(sched)
    assert out.num_preempted == 1 and [g.request_id for g in sched.waiting] == ["b"]
    assert [m.request_id for m in metadata] == ["a"]
    assert seq_b.status == SequenceStatus.WAITING and seq_b.data.get_num_computed_tokens() == 0
    assert seq_b.is_prefill() and a.get_seqs()[0].get_len() == 5


def test_pipeline_micro_batches_are_balanced_by_tokens() -> None:
    # One chunk of a prompt at a time (VLLM_PP_CHUNKED_PIPELINING=0).
    sched = _scheduler(budget=64, gpu=256, pp=2, pipeline_chunks=False)
    decoders = [_add(sched, f"d{i}", 2, arrival=float(i)) for i in range(8)]
    while any(g.is_prefill() for g in decoders):
        metadata, _ = schedule_rows(sched)
        _return(sched, metadata)
    assert all(not g.is_prefill() for g in decoders)
    _add(sched, "long", 100, arrival=100.0)
    # One round through two stages: 8 decode tokens + up to 64 prompt tokens; each
    # micro-batch takes half of the decodes and half of that prefill work.
    assert sched.budget.max_batch_seqs(sched.num_active_seqs()) == 5
    first, out1 = schedule_rows(sched)
    second, out2 = schedule_rows(sched)
    assert [(m.request_id, m.token_chunk_size) for m in first] == [
        ("long", 32),
        ("d0", 1),
        ("d1", 1),
        ("d2", 1),
        ("d3", 1),
    ]
    # The long prompt is in flight; the second micro-batch takes the other decodes.
    assert [m.request_id for m in second] == ["d4", "d5", "d6", "d7"]
    assert (out1.num_batched_tokens, out2.num_batched_tokens) == (36, 4)
    # Without pipelining a step takes every decode and fills the budget with the prompt.
    sched.budget = MicroBatchBudget.from_config(sched.scheduler_config)
    _return(sched, first + second)
    third, out3 = schedule_rows(sched)
    assert third[0].request_id == "long" and third[0].token_chunk_size == 56
    assert out3.num_batched_tokens == 64


def test_config_rules_and_cli_flags() -> None:
    chunked = SchedulerConfig(max_model_len=4096, enable_chunked_prefill=True)
    assert chunked.max_num_batched_tokens == 512 and chunked.chunked_prefill_enabled
    SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=8, max_model_len=4096, enable_chunked_prefill=True
    )
    with pytest.raises(ValueError, match="is smaller than max_model_len"):
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=4096)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(
        parser.parse_args(["--enable-chunked-prefill", "--enable-prefix-caching"])
    )
    assert args.enable_chunked_prefill and args.enable_prefix_caching
    defaults = EngineArgs.from_cli_args(parser.parse_args([]))
    assert not defaults.chunked_prefill_requested() and not defaults.enable_prefix_caching
    # The servers' arguments default to chunked prefill (vLLM V1's default); the flag's
    # negative form turns it off, and an explicit value wins everywhere.
    serve = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    assert AsyncEngineArgs.from_cli_args(serve.parse_args([])).chunked_prefill_requested()
    off = AsyncEngineArgs.from_cli_args(serve.parse_args(["--no-enable-chunked-prefill"]))
    assert off.enable_chunked_prefill is False and not off.chunked_prefill_requested()
    assert not EngineArgs().chunked_prefill_requested()
    assert AsyncEngineArgs().chunked_prefill_requested()
    assert not AsyncEngineArgs(enable_chunked_prefill=False).chunked_prefill_requested()
    assert EngineArgs(enable_chunked_prefill=True).chunked_prefill_requested()


def test_sequence_data_computed_tokens_and_forks() -> None:
    seq = Sequence(next(_seq_ids), "p", list(range(10)), block_size=4)
    assert seq.is_prefill() and seq.get_num_new_tokens() == 10
    seq.data.update_num_computed_tokens(6)
    assert seq.is_prefill() and seq.get_num_new_tokens() == 4
    seq.data.update_num_computed_tokens(4)
    assert not seq.is_prefill()
    seq.append_token_id(3, {3: Logprob(0.0)})
    assert seq.get_num_new_tokens() == 1 and seq.data.get_num_uncomputed_tokens() == 1
    light = seq.fork_light(next(_seq_ids))
    assert not light.is_prefill() and light.data.get_num_computed_tokens() == 10
    seq.reset_for_recompute()
    assert seq.is_prefill() and seq.get_num_new_tokens() == 11


def test_diverged_recompute_group_too_big_for_a_step_is_ignored_not_hung() -> None:
    """After a recompute, samples that diverged are prefilled whole (never chunked): if they
    cannot fit one step together they end as ignored instead of waiting forever."""
    sched = _scheduler(budget=8)
    seqs = [Sequence(next(_seq_ids), "p", list(range(5)), block_size=4) for _ in range(2)]
    seqs[1].append_token_id(9, {9: Logprob(0.0)})  # 5 + 6 tokens > 8
    group = SequenceGroup("div", seqs, _Params(n=2, best_of=2), arrival_time=0.0)
    sched.add_seq_group(group)
    small = [Sequence(next(_seq_ids), "p", [1, 2, 3], block_size=4) for _ in range(2)]
    small[1].append_token_id(9, {9: Logprob(0.0)})
    fits = SequenceGroup("fits", small, _Params(n=2, best_of=2), arrival_time=1.0)
    sched.add_seq_group(fits)
    metadata, out = schedule_rows(sched)
    assert out.ignored_seq_groups == [group]
    assert [(m.request_id, len(m.seq_data), m.do_sample) for m in metadata] == [("fits", 2, True)]
    assert out.num_batched_tokens == 7
    sched.finish_in_flight(["fits"])
    assert all(not s.is_prefill() for s in small)


def test_vllm_pp_micro_batches_sizes_every_micro_batch_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """VLLM_PP_MICRO_BATCHES sets the cohorts once (the engine's budget): the sequence cap, the
    chunked token budget and the scheduling-ahead gap all divide by it, not by the pipeline
    size (the token budget used to divide by the pipeline size while the engine split the
    sequences by the variable)."""
    monkeypatch.setenv("VLLM_PP_MICRO_BATCHES", "4")
    config = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=16, max_model_len=128, enable_chunked_prefill=True
    )
    assert MicroBatchBudget.for_pipeline(config, 1).cohorts == 1  # no pipeline: ignored
    budget = MicroBatchBudget.for_pipeline(config, 2)
    assert budget.cohorts == 4
    cache = CacheConfig(block_size=4, num_gpu_blocks=256, num_cpu_blocks=8)
    sched = Scheduler(config, cache, budget, schedule_ahead=True)
    decoders = [_add(sched, f"d{i}", 2, arrival=float(i)) for i in range(8)]
    step = 0
    while any(g.is_prefill() for g in decoders):
        step += 1
        metadata, _ = schedule_rows(sched, step)
        _return(sched, metadata)
    _add(sched, "long", 100, arrival=100.0)
    # 9 active sequences over 4 cohorts: at most 3 per micro-batch. Tokens: a quarter of
    # the 8 decodes (2) and a quarter of the 64 prompt tokens a round may take (16).
    assert budget.max_batch_seqs(sched.num_active_seqs()) == 3
    first, out = schedule_rows(sched, step + 1)
    assert [(m.request_id, m.token_chunk_size) for m in first] == [
        ("long", 16),
        ("d0", 1),
        ("d1", 1),
    ]
    assert out.num_batched_tokens == 18
    # A decode in flight as step s may go ahead from step s + 4 on (4 - 1 steps between).
    d0 = decoders[0]
    for later, allowed in [(1, False), (2, False), (3, False), (4, True)]:
        assert sched.can_go_ahead(d0, step + 1 + later) is allowed


def _chunk_rows(metadata) -> list[tuple[str, int, int, bool]]:
    """(request, chunk start as the stage sees it, chunk size, samples) per prompt row."""
    rows = []
    for m in metadata:
        if m.is_prompt:
            (data,) = m.seq_data.values()
            rows.append(
                (m.request_id, data.get_num_computed_tokens(), m.token_chunk_size, m.do_sample)
            )
    return rows


def test_chunks_of_one_prompt_are_in_flight_together() -> None:
    """Chunked pipelining: with two micro-batches the next chunk of a prompt is scheduled
    while the earlier one is still in the pipeline, starting where that one ends; only the
    last samples; the KV counts as computed chunk by chunk, in order; decoding starts only
    once the last chunk is back."""
    sched = _scheduler(budget=16, gpu=64, pp=2)
    long = _add(sched, "long", 40)
    seq = long.get_seqs()[0]
    # The stage's rows share its sequence objects: read each step's chunk when it is written.
    first, _ = schedule_rows(sched, step_no=1)
    assert _chunk_rows(first) == [("long", 0, 8, False)]
    second, _ = schedule_rows(sched, step_no=2)
    assert _chunk_rows(second) == [("long", 8, 8, False)]
    assert [f.num_tokens for f in long.flights] == [8, 8]
    _return(sched, first)  # the oldest step comes back first
    assert seq.data.get_num_computed_tokens() == 8 and long.is_in_flight()
    third, _ = schedule_rows(sched, step_no=3)
    assert _chunk_rows(third) == [("long", 16, 8, False)]
    _return(sched, second)
    _return(sched, third)
    assert seq.data.get_num_computed_tokens() == 24
    steps, chunks = [], []
    for step_no in (4, 5, 6):
        rows, _ = schedule_rows(sched, step_no=step_no)
        steps.append(rows)
        chunks.append(_chunk_rows(rows))
    # 16 tokens left: two chunks of 8, the second samples; nothing more until they are back.
    assert chunks == [
        [("long", 24, 8, False)],
        [("long", 32, 8, True)],
        [],
    ]
    _return(sched, steps[0])
    assert long.is_prefill() and not schedule_rows(sched, step_no=6)[1].scheduled_seq_groups
    _return(sched, steps[1])
    assert not long.is_prefill() and seq.get_output_len() == 1
    decode, _ = schedule_rows(sched, step_no=7)
    assert [(m.request_id, m.is_prompt) for m in decode] == [("long", False)]


def test_chunks_in_flight_off_with_one_micro_batch_or_switched_off() -> None:
    for pp, pipeline_chunks in ((1, True), (2, False)):
        sched = _scheduler(budget=16, gpu=64, pp=pp, pipeline_chunks=pipeline_chunks)
        _add(sched, "long", 40)
        schedule_rows(sched, step_no=1)
        assert schedule_rows(sched, step_no=2)[1].is_empty()


def test_abort_and_lost_steps_with_several_chunks_in_flight() -> None:
    """An abort while three chunks are in flight frees the blocks only when the last one is
    back; a pipeline that lost its steps rolls the prompt back to its committed chunks."""
    sched = _scheduler(budget=16, gpu=64, pp=2)
    free_before = sched.block_manager.get_num_free_gpu_blocks()
    _add(sched, "a", 40)
    steps, starts = [], []
    for n in (1, 2, 3):
        rows, _ = schedule_rows(sched, step_no=n)
        steps.append(rows)
        starts.append(_chunk_rows(rows)[0][1])
    assert starts == [0, 8, 16]
    sched.abort_seq_group("a")
    for rows in steps[:2]:
        sched.finish_in_flight([m.request_id for m in rows])
        assert sched.block_manager.get_num_free_gpu_blocks() < free_before
    sched.finish_in_flight([m.request_id for m in steps[2]])
    assert sched.block_manager.get_num_free_gpu_blocks() == free_before
    assert not sched.in_flight and not sched.has_unfinished_seqs()

    b = _add(sched, "b", 40)
    steps = [schedule_rows(sched, step_no=n)[0] for n in (4, 5, 6)]
    _return(sched, steps[0])  # committed: 8 tokens; two chunks are lost with the pipeline
    sched.drop_steps_in_flight()
    assert b.get_seqs()[0].data.get_num_computed_tokens() == 8 and not b.is_in_flight()
    rows, _ = schedule_rows(sched, step_no=7)
    assert _chunk_rows(rows) == [("b", 8, 8, False)]


def test_long_prefill_token_threshold_caps_one_prompt_per_step() -> None:
    """vLLM's long_prefill_token_threshold: one prompt takes at most that many tokens of a
    step; the rest of the budget goes to the next prompt."""
    cache = CacheConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=8)
    config = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=8,
        max_model_len=128,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=6,
    )
    sched = Scheduler(config, cache, MicroBatchBudget.from_config(config))
    _add(sched, "a", 30, arrival=0.0)
    _add(sched, "b", 30, arrival=1.0)
    _add(sched, "c", 30, arrival=2.0)
    metadata, out = schedule_rows(sched)
    assert [(m.request_id, m.token_chunk_size) for m in metadata] == [
        ("a", 6),
        ("b", 6),
        ("c", 4),
    ]
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        SchedulerConfig(enable_chunked_prefill=True, long_prefill_token_threshold=-1)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--long-prefill-token-threshold", "64"]))
    assert args.long_prefill_token_threshold == 64
