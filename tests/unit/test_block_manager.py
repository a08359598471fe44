"""BlockSpaceManager: allocation accounting, copy-on-write, watermark, swap (no torch)."""

from __future__ import annotations

import pytest

from tests.utils.fake_requests import FakeParams as _Params
from tests.utils.fake_requests import seq_ids as _seq_ids
from vllm.core.block_manager import AllocStatus, BlockSpaceManager, _BlockAllocator
from vllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus

# Torch-free unit tests: part of `make test-fast`.
pytestmark = pytest.mark.fast


def _group(request_id: str, prompt_len: int, block_size: int = 4) -> SequenceGroup:
    seq = Sequence(next(_seq_ids), "p", list(range(prompt_len)), block_size)
    return SequenceGroup(request_id, [seq], _Params(), arrival_time=0.0)


def _append(seq: Sequence, token: int = 7) -> None:
    seq.append_token_id(token, {token: Logprob(0.0)})


def _fork(group: SequenceGroup, bm: BlockSpaceManager) -> Sequence:
    parent = group.get_seqs()[0]
    child = parent.fork(next(_seq_ids))
    group.add(child)
    bm.fork(parent, child)
    return child


def _admit(bm: BlockSpaceManager, group: SequenceGroup) -> Sequence:
    bm.allocate(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.RUNNING
    return group.get_seqs()[0]


def test_allocate_append_free_returns_to_all_free() -> None:
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    group = _group("a", 6)
    assert bm.can_allocate(group) == AllocStatus.OK
    seq = _admit(bm, group)
    assert bm.get_block_table(seq) == [0, 1]
    assert bm.get_num_free_gpu_blocks() == 6
    _append(seq)  # len 7: still inside block 1
    assert bm.append_slots(seq) == []
    _append(seq)  # len 8: fills block 1
    assert bm.append_slots(seq) == []
    assert bm.get_block_table(seq) == [0, 1]
    _append(seq)  # len 9: needs a third block
    assert bm.append_slots(seq) == []
    assert bm.get_block_table(seq) == [0, 1, 2]
    assert bm.get_num_free_gpu_blocks() == 5
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 8
    assert bm.get_num_free_cpu_blocks() == 4
    bm.free(seq)  # no table any more: no-op, not a double free
    assert bm.get_num_free_gpu_blocks() == 8


def test_copy_on_write_after_fork() -> None:
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    group = _group("a", 3)
    parent = _admit(bm, group)
    _append(parent)  # len 4: the last token shares block 0 once forked
    child = _fork(group, bm)
    assert bm.get_block_table(child) == [0]
    assert bm.get_num_free_gpu_blocks() == 7
    assert bm.append_slots(parent) == [(0, 1)]
    assert bm.get_block_table(parent) == [1]
    # Block 0 is now the child's alone: it writes in place.
    assert bm.append_slots(child) == []
    assert bm.get_block_table(child) == [0]
    assert bm.get_num_free_gpu_blocks() == 6
    # The next token opens a fresh block for each: no copy needed.
    _append(parent)
    _append(child)
    assert bm.append_slots(parent) == []
    assert bm.append_slots(child) == []
    assert bm.get_block_table(parent) == [1, 2]
    assert bm.get_block_table(child) == [0, 3]
    bm.free(parent)
    bm.free(child)
    assert bm.get_num_free_gpu_blocks() == 8


def test_allocate_shares_prompt_between_waiting_seqs() -> None:
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0.0)
    group = _group("a", 5)
    group.add(group.get_seqs()[0].fork(next(_seq_ids)))
    bm.allocate(group)
    first, second = group.get_seqs()
    assert bm.get_block_table(first) == bm.get_block_table(second) == [0, 1]
    assert bm.get_num_free_gpu_blocks() == 2
    bm.free(first)
    assert bm.get_num_free_gpu_blocks() == 2  # still referenced by the second
    bm.free(second)
    assert bm.get_num_free_gpu_blocks() == 4


def test_double_free_and_unknown_block_raise() -> None:
    allocator = _BlockAllocator("gpu", 2)
    block = allocator.allocate()
    allocator.free(block)
    with pytest.raises(ValueError, match="Double free!"):
        allocator.free(block)
    with pytest.raises(ValueError, match="Unknown gpu block"):
        allocator.free(5)
    allocator.allocate()
    allocator.allocate()
    with pytest.raises(ValueError, match="Out of memory"):
        allocator.allocate()


def test_watermark_never_and_later() -> None:
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.2)
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(_group("huge", 33)) == AllocStatus.NEVER  # 9 blocks, 10 - 9 < 2
    assert bm.can_allocate(_group("max", 32)) == AllocStatus.OK  # 8 blocks leave exactly 2
    first = _admit(bm, _group("a", 16))
    assert bm.get_num_free_gpu_blocks() == 6
    assert bm.can_allocate(_group("b", 16)) == AllocStatus.OK  # 6 - 4 == watermark
    late = _group("c", 20)
    assert bm.can_allocate(late) == AllocStatus.LATER  # 6 - 5 < watermark
    bm.free(first)
    assert bm.can_allocate(late) == AllocStatus.OK


def test_can_append_slots_needs_one_block_per_running_seq() -> None:
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=0, watermark=0.0)
    group = _group("a", 8)
    _admit(bm, group)
    _fork(group, bm)
    assert bm.get_num_free_gpu_blocks() == 1
    assert not bm.can_append_slots(group)
    group.get_seqs()[1].status = SequenceStatus.FINISHED_STOPPED
    assert bm.can_append_slots(group)


def test_swap_out_and_in_round_trip_preserves_mapping() -> None:
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    other = _admit(bm, _group("other", 8))  # takes gpu 0 and 1
    group = _group("a", 6)
    parent = _admit(bm, group)
    child = _fork(group, bm)
    _append(child)  # len 7 in the shared block 3: copy-on-write
    assert bm.append_slots(child) == [(3, 4)]
    old = {s.seq_id: bm.get_block_table(s) for s in (parent, child)}
    assert old == {parent.seq_id: [2, 3], child.seq_id: [2, 4]}

    assert bm.can_swap_out(group)
    out = bm.swap_out(group)
    assert out == {2: 0, 3: 1, 4: 2}  # the shared block 2 is copied once
    for seq in group.get_seqs():
        seq.status = SequenceStatus.SWAPPED
    assert bm.get_block_table(parent) == [0, 1]
    assert bm.get_block_table(child) == [0, 2]
    assert bm.get_num_free_gpu_blocks() == 6
    assert bm.get_num_free_cpu_blocks() == 5

    bm.free(other)
    _admit(bm, _group("squatter", 4))  # takes gpu 0, so swap-in lands elsewhere
    assert bm.can_swap_in(group) == AllocStatus.OK  # 3 blocks + 1 per seq <= 7 free
    back = bm.swap_in(group)
    assert back == {0: 1, 1: 2, 2: 3}
    for seq in (parent, child):
        assert bm.get_block_table(seq) == [back[out[b]] for b in old[seq.seq_id]]
    assert bm.get_num_free_cpu_blocks() == 8
    assert bm.get_num_free_gpu_blocks() == 4
    # Block 1 (the shared prompt block) is still shared: freeing one seq keeps it.
    bm.free(parent)
    assert bm.get_num_free_gpu_blocks() == 5
    bm.free(child)
    assert bm.get_num_free_gpu_blocks() == 7


def test_can_swap_in_reserves_next_token_and_can_swap_out_needs_cpu_room() -> None:
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=5, num_cpu_blocks=2, watermark=0.0)
    group = _group("a", 8)
    _admit(bm, group)
    big = _group("big", 12)
    _admit(bm, big)
    assert not bm.can_swap_out(big)  # 3 blocks, 2 cpu blocks
    assert bm.can_swap_out(group)
    bm.swap_out(group)
    group.get_seqs()[0].status = SequenceStatus.SWAPPED
    assert bm.get_num_free_gpu_blocks() == 2
    assert bm.can_swap_in(group) == AllocStatus.LATER  # 2 blocks + 1 for the next token > 2 free
    bm.free(big.get_seqs()[0])
    assert bm.can_swap_in(group) == AllocStatus.OK


def test_reset_frees_everything() -> None:
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=2, watermark=0.0)
    seq = _admit(bm, _group("a", 9))
    bm.reset()
    assert bm.get_num_free_gpu_blocks() == 4
    assert bm.get_num_free_cpu_blocks() == 2
    with pytest.raises(KeyError):
        bm.get_block_table(seq)


def test_shrink_keeps_every_table_when_no_block_in_use_is_above_the_new_count() -> None:
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8)
    first = _admit(bm, _group("a", 8))  # blocks 0, 1
    second = _admit(bm, _group("b", 4))  # block 2
    assert bm.why_not_shrink(2, 8) == "gpu block 2 is in use, beyond 2 blocks"
    assert bm.shrink(2, 8) is not None
    assert bm.num_total_gpu_blocks == 16  # refused: nothing changed
    assert bm.shrink(3, 4) is None
    assert (bm.num_total_gpu_blocks, bm.num_total_cpu_blocks) == (3, 4)
    assert bm.get_block_table(first) == [0, 1] and bm.get_block_table(second) == [2]
    assert bm.get_num_free_gpu_blocks() == 0 and bm.get_num_free_cpu_blocks() == 4
    bm.free(second)
    assert bm.get_num_free_gpu_blocks() == 1
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        bm.shrink(4, 4)


def test_allocator_truncate_drops_free_and_parked_blocks_above() -> None:
    allocator = _BlockAllocator("gpu", 8)
    forgotten: list[int] = []
    allocator.keep_cached = lambda block: True
    allocator.on_evict = forgotten.append
    blocks = [allocator.allocate() for _ in range(6)]  # 0..5
    allocator.free(blocks[5])  # parked in the evictor
    allocator.free(blocks[1])
    allocator.truncate(5)
    assert forgotten == [5]
    assert allocator.num_free() == 1  # block 1 (parked); 5, 6 and 7 are gone
    assert allocator.first_in_use_from(0) == 0
    assert allocator.high_water == 5
