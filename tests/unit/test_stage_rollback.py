"""The scheduler's side of a stage-local rebuild: in-flight groups roll back to their committed
state keeping their blocks, untrusted groups are re-queued in full, and the replay steps cover
exactly each kept sequence's committed tokens in chunks."""

from __future__ import annotations

import argparse
import pickle

import pytest

from tests.utils.fake_requests import FakeParams, seq_ids
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.block_manager import AllocStatus
from vllm.core.budget import MicroBatchBudget
from vllm.core.scheduler import Scheduler
from vllm.core.stage_rollback import (
    end_swap_round,
    next_swap_round,
    requeue_after_replay,
    roll_back_for_replay,
)
from vllm.distributed.serialization import RefusedGlobalError, dumps_message, loads_message
from vllm.resilience.replay import replay_steps, replay_tokens, run_replay
from vllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus
from vllm.step_records import (
    BlockOps,
    CachedRequestData,
    ExecuteModelRequest,
    ReplayPlan,
    StepMessage,
)
from vllm.worker.request_table import replay_rows

pytestmark = pytest.mark.fast


def _scheduler(
    chunked: bool = False, num_cpu_blocks: int = 8, prefix_caching: bool = False
) -> Scheduler:
    cache = CacheConfig(
        block_size=4,
        num_gpu_blocks=32,
        num_cpu_blocks=num_cpu_blocks,
        enable_prefix_caching=prefix_caching,
    )
    config = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=64,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, cache, MicroBatchBudget.from_config(config, 1))


def _add(sched: Scheduler, request_id: str, prompt_len: int) -> SequenceGroup:
    seq = Sequence(next(seq_ids), "p", list(range(prompt_len)), block_size=4)
    group = SequenceGroup(request_id, [seq], FakeParams(), arrival_time=0.0)
    sched.add_seq_group(group)
    return group


def _run_once(sched: Scheduler) -> list[SequenceGroup]:
    """Schedule a step, commit it and bring it back with one token per running sequence."""
    _, out = sched.schedule(1)
    sched.commit_step(out)
    groups = out.scheduled_seq_groups
    sched.finish_in_flight([g.request_id for g in groups])
    for group in groups:
        for seq in group.get_seqs(status=SequenceStatus.RUNNING):
            seq.append_token_id(7, {7: Logprob(0.0)})
    return groups


def test_in_flight_decode_rolls_back_and_replays_its_committed_tokens():
    sched = _scheduler()
    a = _add(sched, "a", 10)
    _run_once(sched)  # a's prompt is computed, one token out: 11 tokens, 10 committed
    _, out = sched.schedule(2)  # a's decode goes in flight (its slot for token 11 appended)
    sched.commit_step(out)
    b = _add(sched, "b", 5)
    _, out_b = sched.schedule(3)  # b's prompt in flight too
    sched.commit_step(out_b)
    assert a.is_in_flight() and b.is_in_flight()
    free_before = sched.block_manager.get_num_free_gpu_blocks()
    plan = roll_back_for_replay(sched)
    assert [g.request_id for g in plan.replayed] == ["a"]
    # b's whole prompt runs again when scheduled (classic scheduling): recomputed in full.
    assert set(plan.recomputed) == {"b"} and list(sched.waiting) == [b]
    assert not sched.in_flight and not a.is_in_flight()
    seq = a.get_seqs()[0]
    assert seq.data.get_num_computed_tokens() == 10 and seq.get_len() == 11
    # a kept its blocks; only b's were freed.
    assert sched.block_manager.get_num_free_gpu_blocks() == free_before + 2
    steps = replay_steps(plan.replayed, sched.block_manager, 4)
    assert [[(m.seqs[0].data.get_num_computed_tokens(), m.token_chunk_size)
             for m in step] for step in steps] == [[(0, 4)], [(4, 4)], [(8, 2)]]  # fmt: skip
    assert replay_tokens(steps) == 10
    assert all(not m.do_sample and m.is_prompt for step in steps for m in step)
    table = sched.block_manager.get_block_table(seq)
    # Scheduled again: a decodes token 11 in the slot it already had, b is admitted.
    groups = _run_once(sched)
    assert {g.request_id for g in groups} <= {"a", "b"}
    assert sched.block_manager.get_block_table(seq) == table


def test_a_group_a_lost_step_swapped_out_comes_back_with_the_replay():
    """Every survivor applied the lost step's swap-out (or the replay applies it first when
    its submission failed): the group's host blocks are trusted and it is swapped in with the
    replay, its committed tokens replayed on the replaced stage only."""
    sched = _scheduler(chunked=True)
    c = _add(sched, "c", 8)
    _run_once(sched)
    c_seq = c.get_seqs()[0]
    sched.running.remove(c)
    mapping = sched.block_manager.swap_out(c)
    c_seq.status = SequenceStatus.SWAPPED
    sched.swapped.append(c)
    plan = roll_back_for_replay(sched)
    assert not plan.recomputed and plan.swapped_in == ["c"]
    assert [g.request_id for g in plan.replayed] == ["c"]
    assert c_seq.status == SequenceStatus.RUNNING
    # Swapped back in from the very host blocks the swap-out wrote.
    assert set(plan.blocks_to_swap_in) == set(mapping.values())
    assert c_seq.data.get_num_computed_tokens() == 8
    steps = replay_steps(plan.replayed, sched.block_manager, 64)
    assert replay_tokens(steps) == 8


def test_a_swapped_group_with_no_room_stays_swapped_and_is_rebuilt_in_a_round():
    """No room to swap it in with the replay: it stays swapped (not recomputed), and its
    round swaps out a running request to make room (that request lends its blocks), swaps it
    in for its replay, then swaps it out and the lender back in."""
    sched = _scheduler(chunked=True, num_cpu_blocks=32)
    big = _add(sched, "big", 56)  # 15 of the 32 device blocks once it decodes
    c = _add(sched, "c", 8)
    _run_once(sched)
    bm = sched.block_manager
    c_seq, big_seq = c.get_seqs()[0], big.get_seqs()[0]
    sched.running.remove(c)
    bm.swap_out(c)
    c_seq.status = SequenceStatus.SWAPPED
    sched.swapped.append(c)
    # Blocks held elsewhere (a request that cannot lend them): no room for c now.
    hog = Sequence(next(seq_ids), "p", list(range(68)), block_size=4)
    bm.allocate(SequenceGroup("hog", [hog], FakeParams(), arrival_time=0.0))
    assert bm.can_swap_in(c) != AllocStatus.OK and bm.get_num_free_gpu_blocks() < 2
    plan = roll_back_for_replay(sched)
    assert plan.swap_rounds == [c] and not plan.recomputed and not plan.swapped_in
    assert list(sched.swapped) == [c] and c_seq.status == SequenceStatus.SWAPPED
    assert plan.replayed == [big]
    assert next_swap_round(sched, c, []) is None  # nobody to lend: nothing changed
    host = bm.get_num_free_cpu_blocks()
    assert c_seq.status == SequenceStatus.SWAPPED and bm.num_swapped_blocks(c) == 2
    big_blocks = len(bm.get_block_table(big_seq))
    swap_round = next_swap_round(sched, c, plan.replayed)
    assert swap_round is not None and swap_round.lent == [big]
    lend_out, c_in = swap_round.before
    assert len(lend_out.swap_out) == big_blocks and len(c_in.swap_in) == 2
    assert c_seq.status == SequenceStatus.RUNNING and big_seq.status == SequenceStatus.SWAPPED
    assert replay_tokens(replay_steps([c], bm, 64)) == 8
    c_out, big_in = end_swap_round(sched, swap_round)
    assert set(c_out.swap_out) == set(c_in.swap_in.values())
    assert set(big_in.swap_in) == set(lend_out.swap_out.values())
    assert c_seq.status == SequenceStatus.SWAPPED and big_seq.status == SequenceStatus.RUNNING
    assert len(bm.get_block_table(big_seq)) == big_blocks and bm.num_swapped_blocks(c) == 2
    assert bm.get_num_free_cpu_blocks() == host
    assert list(sched.running) == [big] and list(sched.swapped) == [c]


def test_a_whole_prompt_in_flight_with_a_cached_prefix_keeps_that_prefix():
    """Classic scheduling runs a prompt whole, so one in flight waits again; but the prefix it
    took from the cache is committed KV: it is replayed with the others and then re-queued,
    so the prefix stays cached (valid on the rebuilt stage too) and is not computed again."""
    sched = _scheduler(prefix_caching=True)
    _add(sched, "a", 10)
    _run_once(sched)  # a's prompt is computed and its 2 full blocks cached
    twin = _add(sched, "twin", 10)  # the same 10 tokens: 8 of them come from the cache
    _, out = sched.schedule(1)
    sched.commit_step(out)
    assert twin.is_in_flight()
    twin_seq = twin.get_seqs()[0]
    assert twin_seq.data.get_num_computed_tokens() == 8
    plan = roll_back_for_replay(sched)
    assert not plan.recomputed and set(plan.requeue_after) == {"twin"}
    assert twin in plan.replayed
    steps = replay_steps(plan.replayed, sched.block_manager, 64)
    assert replay_tokens(steps) == 10 + 8  # a's committed tokens, twin's cached prefix
    assert requeue_after_replay(sched, plan) == [twin]
    assert list(sched.waiting) == [twin] and twin not in sched.running
    assert sched.block_manager.num_cached_tokens(twin) == 8


def test_stage_recovery_flag():
    """`stage_recovery` is validated by name; the boundary cache exists only with "local",
    PP > 1 and stages that may be replaced."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="stage_recovery must be 'local' or 'full'"):
        ParallelConfig(2, distributed_executor_backend="mp", stage_recovery="partial")
    assert ParallelConfig(2, distributed_executor_backend="mp").boundary_cache_enabled
    assert not ParallelConfig(
        2, distributed_executor_backend="mp", stage_recovery="full"
    ).boundary_cache_enabled
    assert not ParallelConfig(
        2, distributed_executor_backend="mp", max_stage_restarts=0
    ).boundary_cache_enabled
    assert not ParallelConfig(1).boundary_cache_enabled
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--model", "m", "--stage-recovery", "full"]).stage_recovery == "full"
    assert parser.parse_args(["--model", "m"]).stage_recovery == "local"


def test_the_block_bound_covers_every_block_a_kept_request_holds():
    """A request admitted while others held the low blocks gets high block ids; when those
    others are gone, a bound summed over the running requests alone would fall below its
    blocks. A replaced stage maps and zeroes its new cache up to the bound, and a block it
    first sees inside the bound later is zeroed then: the rebuilt KV of that request would
    be wiped. So the bound replayed with never falls below a block in use."""
    sched = _scheduler()
    early = [_add(sched, f"early{i}", 14) for i in range(6)]  # 4 blocks each: 0-23
    _run_once(sched)
    late = _add(sched, "late", 6)  # 2 blocks: the lowest free ones, 24 and 25
    _run_once(sched)
    table = sched.block_manager.get_block_table(late.get_seqs()[0])
    assert min(table) >= 24
    sched.abort_seq_group([g.request_id for g in early])
    _run_once(sched)
    plan = roll_back_for_replay(sched)
    assert [g.request_id for g in plan.replayed] == ["late"]
    # "late" alone needs at most ceil(64 / 4) = 16 blocks: below its block ids.
    assert sched.kv_blocks_bound() > max(sched.block_manager.get_block_table(late.get_seqs()[0]))


def test_a_replay_step_travels_as_a_step_message():
    """A replay step is an ordinary step on the wire: an `ExecuteModelRequest` whose
    `StepMessage` carries one `NewRequestData` prefill chunk per committed sequence and a
    `ReplayPlan`. It crosses the stages' message reader as is, and a stage reads from it the
    rows the chunks describe (start, length, tokens, block table), without a request table."""
    sched = _scheduler()
    a = _add(sched, "a", 10)
    _run_once(sched)  # 11 tokens, 10 committed
    seq = a.get_seqs()[0]
    table = sched.block_manager.get_block_table(seq)
    before, after = [BlockOps(swap_in={1: 30})], [BlockOps(swap_out={30: 1})]
    sent: list[tuple[ExecuteModelRequest, float]] = []
    steps = replay_steps([a], sched.block_manager, 4)
    replayed = run_replay(
        lambda request, timeout: sent.append((request, timeout)),
        lambda tokens: 0.5 + tokens, [1], steps, sched.kv_blocks_bound(), before, after,
    )  # fmt: skip
    assert replayed == 10 and [timeout for _, timeout in sent] == [4.5, 4.5, 2.5]
    for index, (request, _) in enumerate(sent):
        loaded = loads_message(dumps_message(request))
        assert type(loaded) is ExecuteModelRequest and type(loaded.step) is StepMessage
        assert loaded.kv_blocks_bound == sched.kv_blocks_bound()
        plan = loaded.replay_plan("replay_stages")
        assert plan.rebuild_stages == [1]
        assert plan.before == (before if index == 0 else [])
        assert plan.after == (after if index == 2 else [])
        [meta] = replay_rows(loaded.step).groups
        data = meta.seq_data[seq.seq_id]
        assert meta.is_prompt and not meta.do_sample
        chunks = [(0, 4), (4, 4), (8, 2)]
        assert (data.get_num_computed_tokens(), meta.token_chunk_size) == chunks[index]
        assert data.get_token_ids() == seq.get_token_ids()
        assert meta.block_tables == {seq.seq_id: table}


def test_what_is_not_a_replay_step_is_refused(monkeypatch: pytest.MonkeyPatch):
    """A replay verb refuses an ordinary step, a replay whose block operations or records
    its plan does not cover, a payload of another type, and a message in the old replay
    format (`ReplayRequest`, gone): each with an error naming what is wrong."""
    from vllm import step_records
    from vllm.worker.rank_server import WorkerHost

    sched = _scheduler()
    a = _add(sched, "a", 10)
    _run_once(sched)
    [chunk] = replay_steps([a], sched.block_manager, 64)[0]
    with pytest.raises(ValueError, match="replay_stages: not a replay step"):
        ExecuteModelRequest(StepMessage([chunk])).replay_plan("replay_stages")
    plan = ReplayPlan([1])
    own_ops = ExecuteModelRequest(StepMessage([chunk], replay=plan), blocks_to_copy={1: [2]})
    with pytest.raises(ValueError, match="block operations go in its plan"):
        own_ops.replay_plan("replay_stages")
    held = CachedRequestData("a", True, 4, False, ())
    with pytest.raises(ValueError, match="request a: a replay step's records are NewRequestData"):
        ExecuteModelRequest(StepMessage([held], replay=plan)).replay_plan("replay_gained_layers")
    sampled = chunk._replace(do_sample=True)
    with pytest.raises(ValueError, match="sample nothing"):
        ExecuteModelRequest(StepMessage([sampled], replay=plan)).replay_plan("replay_stages")
    # The rank's verb table: a step request, nothing else.
    host = WorkerHost()
    for verb in ("replay_stages", "replay_gained_layers"):
        refused = f"{verb}: parameter 'request' must be ExecuteModelRequest"
        with pytest.raises(TypeError, match=refused):
            host.call(verb, (StepMessage([chunk], replay=plan),), {})

    # The old format, as an engine of an earlier version would write it.
    class ReplayRequest:
        pass

    ReplayRequest.__module__, ReplayRequest.__qualname__ = "vllm.step_records", "ReplayRequest"
    monkeypatch.setattr(step_records, "ReplayRequest", ReplayRequest, raising=False)
    legacy = pickle.dumps(("call", "replay_stages", ReplayRequest()))
    monkeypatch.undo()
    with pytest.raises(RefusedGlobalError, match=r"vllm\.step_records\.ReplayRequest"):
        loads_message(legacy, allow_user_code=True)
