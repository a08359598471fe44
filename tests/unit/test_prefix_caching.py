"""Automatic prefix caching in the block manager and scheduler (no torch): block hashes, reuse of
computed blocks only, the last token's block never shared, LRU eviction, copy-on-write beside
cached blocks, prompt logprobs bypass, hit rate, reset; plus the infeasible-swap rule."""

from __future__ import annotations

import logging

import pytest

from tests.utils.fake_requests import FakeParams as _Params
from tests.utils.fake_requests import seq_ids as _seq_ids
from tests.utils.stage_view import schedule_rows
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.block_manager import AllocStatus, BlockSpaceManager
from vllm.core.scheduler import Scheduler
from vllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus

# Torch-free unit tests: part of `make test-fast`.
pytestmark = pytest.mark.fast


def _group(rid: str, tokens: list[int], params: _Params | None = None) -> SequenceGroup:
    seq = Sequence(next(_seq_ids), "p", tokens, block_size=4)
    return SequenceGroup(rid, [seq], params or _Params(), arrival_time=0.0)


def _bm(num_gpu: int = 16) -> BlockSpaceManager:
    return BlockSpaceManager(4, num_gpu, 8, watermark=0.0, enable_caching=True)


def _admit(bm: BlockSpaceManager, group: SequenceGroup, computed: bool = True) -> Sequence:
    """Allocate, mark running and (as when the batch returns) record the prompt as computed."""
    cached = bm.allocate(group)
    seq = group.get_seqs()[0]
    seq.status = SequenceStatus.RUNNING
    seq.data.update_num_computed_tokens(cached)
    if computed:
        seq.data.update_num_computed_tokens(seq.data.get_num_uncomputed_tokens())
        bm.mark_blocks_computed(seq, seq.data.get_num_computed_tokens())
    return seq


def test_identical_prefix_reuses_computed_blocks_only() -> None:
    bm = _bm()
    prompt = list(range(100, 110))  # 10 tokens: blocks [0-3] [4-7] full, [8-9] partial
    a = _admit(bm, _group("a", prompt), computed=False)
    assert bm.get_block_table(a) == [0, 1, 2]
    # Not written yet (its batch is in the pipeline): nothing is shared.
    early = _group("early", prompt)
    assert bm.num_cached_tokens(early) == 0
    bm.mark_blocks_computed(a, 10)
    b_group = _group("b", prompt)
    assert bm.num_cached_tokens(b_group) == 8
    assert bm.allocate(b_group) == 8
    b = b_group.get_seqs()[0]
    assert bm.get_block_table(b) == [0, 1, 3]  # the partial last block is private
    assert bm.get_num_free_gpu_blocks() == 16 - 4
    # Another prefix (differs in the second block) shares only the first block.
    c_group = _group("c", prompt[:4] + [7] * 6)
    assert bm.allocate(c_group) == 4
    assert bm.get_block_table(c_group.get_seqs()[0])[0] == 0
    # A block's hash covers its whole prefix: the same tokens after another first block
    # are not a hit.
    d_group = _group("d", [1, 2, 3, 4] + prompt[4:])
    assert bm.num_cached_tokens(d_group) == 0


def test_last_token_block_is_never_shared() -> None:
    bm = _bm()
    prompt = list(range(8))  # exactly two full blocks
    _admit(bm, _group("a", prompt))
    again = _group("b", prompt)
    # The second block holds the last token, which must be computed: only one block is hit.
    assert bm.allocate(again) == 4
    assert bm.get_block_table(again.get_seqs()[0]) == [0, 2]


def test_freed_blocks_stay_cached_and_are_evicted_lru_deepest_first() -> None:
    bm = _bm(num_gpu=5)
    first = list(range(13))  # blocks 0, 1, 2 full (cached), block 3 partial
    seq = _admit(bm, _group("a", first))
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 5  # cached blocks count as free
    assert bm.get_num_cached_free_blocks() == 3
    # A different prompt of 3 blocks: the 2 plain free blocks first, then the LRU cached one.
    # Freed last-block-first, the deepest block (2) is the least recently used.
    other = _group("b", [9] * 10)
    assert bm.can_allocate(other) == AllocStatus.OK
    assert bm.allocate(other) == 0
    assert sorted(bm.get_block_table(other.get_seqs()[0])) == [2, 3, 4]
    assert bm.get_num_cached_free_blocks() == 2
    # The first prompt again: blocks 0 and 1 survived, block 2 was evicted and is recomputed.
    again = _group("c", first)
    assert bm.num_cached_tokens(again) == 8
    assert bm.can_allocate(again) == AllocStatus.LATER  # needs 4, has 2 cached + 0 plain
    bm.free(other.get_seqs()[0])
    assert bm.allocate(again) == 8
    assert bm.get_block_table(again.get_seqs()[0])[:2] == [0, 1]


def test_can_allocate_counts_shared_blocks_in_use_as_free_of_charge() -> None:
    bm = _bm(num_gpu=4)
    prompt = list(range(13))  # 4 blocks, 3 full
    _admit(bm, _group("a", prompt))
    assert bm.get_num_free_gpu_blocks() == 0
    twin = _group("b", prompt)
    assert bm.can_allocate(twin) == AllocStatus.LATER  # 3 hits in use, still 1 block short
    bm2 = _bm(num_gpu=5)
    _admit(bm2, _group("a", prompt))
    twin = _group("b", prompt)
    assert bm2.can_allocate(twin) == AllocStatus.OK  # 3 shared + 1 fresh of 1 free
    assert bm2.allocate(twin) == 12


def test_copy_on_write_next_to_cached_blocks() -> None:
    bm = _bm()
    prompt = list(range(6))  # block 0 full (cached), block 1 partial
    _admit(bm, _group("warm", prompt))
    group = _group("n2", prompt, _Params(n=2, best_of=2))
    parent = _admit(bm, group)
    assert bm.get_block_table(parent) == [0, 2]
    child = parent.fork(next(_seq_ids))
    group.add(child)
    bm.fork(parent, child)
    for seq in (parent, child):
        seq.append_token_id(5, {5: Logprob(0.0)})
    # The partial block is copied before the child writes; the cached block is never written.
    assert bm.append_slots(parent) == [(2, 3)]
    assert bm.append_slots(child) == []
    assert bm.get_block_table(parent) == [0, 3] and bm.get_block_table(child) == [0, 2]
    bm.free(parent)
    bm.free(child)
    assert bm.num_cached_tokens(_group("x", prompt)) == 4


def test_prompt_logprobs_requests_compute_every_token_and_hit_rate() -> None:
    bm = _bm()
    prompt = list(range(9))
    _admit(bm, _group("a", prompt))  # 2 full blocks queried, 0 hits
    assert bm.get_prefix_cache_hit_rate() == 0.0
    wants = _group("b", prompt, _Params(prompt_logprobs=1))
    assert bm.allocate(wants) == 0
    _admit(bm, _group("c", prompt))  # 2 queried, 2 hits
    assert bm.get_prefix_cache_hit_rate() == pytest.approx(0.5)
    assert BlockSpaceManager(4, 4, 4).get_prefix_cache_hit_rate() == -1.0


def test_reset_prefix_cache_and_aborted_uncomputed_blocks() -> None:
    bm = _bm()
    prompt = list(range(9))
    seq = _admit(bm, _group("a", prompt), computed=False)
    bm.free(seq)  # aborted before its batch returned: nothing stays cached
    assert bm.get_num_cached_free_blocks() == 0
    assert bm.num_cached_tokens(_group("b", prompt)) == 0
    seq = _admit(bm, _group("c", prompt))
    bm.free(seq)
    assert bm.get_num_cached_free_blocks() == 2
    bm.reset_prefix_cache()
    assert bm.get_num_cached_free_blocks() == 0 and bm.get_num_free_gpu_blocks() == 16
    assert bm.num_cached_tokens(_group("d", prompt)) == 0


def _scheduler(gpu: int, cpu: int, caching: bool = False, **kwargs) -> Scheduler:
    cache = CacheConfig(
        block_size=4, num_gpu_blocks=gpu, num_cpu_blocks=cpu, enable_prefix_caching=caching
    )
    config = SchedulerConfig(
        max_num_batched_tokens=kwargs.pop("max_tokens", 64),
        max_num_seqs=8,
        max_model_len=64,
        **kwargs,
    )
    return Scheduler(config, cache)


def test_scheduler_prefix_hit_waits_for_in_flight_prefix_and_skips_computed_tokens() -> None:
    sched = _scheduler(16, 0, caching=True)
    prompt = list(range(50, 61))  # 11 tokens, 2 full blocks
    a = _group("a", prompt)
    sched.add_seq_group(a)
    metadata, out = schedule_rows(sched)
    assert metadata[0].token_chunk_size == 11 and metadata[0].do_sample
    b = _group("b", prompt)
    sched.add_seq_group(b)
    # a is still in flight: its blocks are not computed yet, so b waits to reuse them
    # instead of computing the same prefix a second time.
    _, out = schedule_rows(sched)
    assert out.is_empty() and list(sched.waiting) == [b]
    sched.finish_in_flight(["a"])
    metadata, out = schedule_rows(sched)
    assert [m.request_id for m in metadata] == ["b"]
    assert metadata[0].is_prompt and metadata[0].token_chunk_size == 3
    assert out.num_batched_tokens == 3
    seq_b = b.get_seqs()[0]
    assert seq_b.data.get_num_computed_tokens() == 8
    assert metadata[0].block_tables[seq_b.seq_id][:2] == [0, 1]
    # A prompt logprobs request computes everything and does not wait.
    c = _group("c", prompt, _Params(prompt_logprobs=1))
    sched.add_seq_group(c)
    metadata, out = schedule_rows(sched)
    assert [m.request_id for m in metadata] == ["c"] and out.num_batched_tokens == 11
    assert sched.get_stats()["gpu_prefix_cache_hit_rate"] == pytest.approx(2 / 4)


def test_infeasible_swapped_beam_group_is_ignored_not_hung(caplog) -> None:
    """The hang of the issue: a beam group (width 4) swapped out that needs more blocks than
    the whole cache to come back ends FINISHED_IGNORED (finish_reason "length")."""
    sched = _scheduler(4, 16, preemption_mode="swap")
    group = _group("beam", list(range(4)), _Params(n=4, best_of=4, use_beam_search=True))
    sched.add_seq_group(group)
    schedule_rows(sched)
    sched.finish_in_flight(["beam"])
    parent = group.get_seqs()[0]
    parent.append_token_id(1, {1: Logprob(0.0)})
    for _ in range(3):  # four beams sharing the prompt block, one block each for the token
        child = parent.fork(next(_seq_ids))
        group.add(child)
        sched.fork_seq(parent, child)
    _, out = schedule_rows(sched)  # 4 beams need 4 new blocks, 3 are free: swapped out
    assert out.num_preempted == 1 and list(sched.swapped) == [group]
    assert sched.block_manager.get_num_free_gpu_blocks() == 4
    with caplog.at_level(logging.WARNING, logger="vllm.core.scheduler"):
        _, out = schedule_rows(sched)  # 1 block + 4 new > 4 blocks: can never be swapped in
    assert out.ignored_seq_groups == [group]
    assert "Failing the request beam because there's not enough kv cache blocks" in caplog.text
    assert all(s.status == SequenceStatus.FINISHED_IGNORED for s in group.get_seqs())
    assert SequenceStatus.get_finished_reason(group.get_seqs()[0].status) == "length"
    assert not sched.has_unfinished_seqs()
    assert sched.block_manager.get_num_free_cpu_blocks() == 16
