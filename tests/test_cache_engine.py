"""CacheEngine's CPU first-touch policy: blocks are zeroed ahead of their first write in whole
chunks (one chunk of headroom past the last block written), never twice, and the cache
operations that write blocks (swap in, copy) go through it too. The CPU cache lives on its own
huge-page mappings."""

from __future__ import annotations

import torch

from vllm.worker.cache_engine import CacheEngine
from vllm.worker.cpu_memory import HUGE_PAGE, huge_page_empty

BLOCKS, BLOCK_SIZE = 64, 4  # chunks of 64 // 16 = 4 blocks


def make_cache() -> CacheEngine:
    cache = CacheEngine(2, 2, 8, BLOCK_SIZE, BLOCKS, 8, torch.float32, torch.device("cpu"))
    for key, value in cache.gpu_cache:  # what torch.empty may hold: garbage
        key.fill_(float("nan"))
        value.fill_(float("nan"))
    return cache


def zeroed_blocks(cache: CacheEngine) -> list[int]:
    key = cache.gpu_cache[1][0]
    return [b for b in range(BLOCKS) if bool((key[b] == 0).all())]


def test_nothing_is_touched_up_front():
    cache = make_cache()
    assert cache.touched_blocks == 0 and zeroed_blocks(cache) == []


def test_slots_touch_whole_chunks_up_to_the_last_written_block():
    cache = make_cache()
    # Slot 9 lies in block 2 (chunk [0, 4)), so blocks up to the end of the next chunk; -1 is
    # padding.
    cache.prepare_slots(torch.tensor([-1, 9, 0]))
    assert cache.touched_blocks == 8 and zeroed_blocks(cache) == list(range(8))
    cache.prepare_slots(torch.tensor([7 * BLOCK_SIZE]))  # inside the headroom: nothing to do
    assert cache.touched_blocks == 8
    # Block 17 -> chunk [16, 20) plus [20, 24); blocks 8..15 are zeroed too (they lie below).
    cache.prepare_slots(torch.tensor([17 * BLOCK_SIZE + 3]))
    assert cache.touched_blocks == 24 and zeroed_blocks(cache) == list(range(24))
    for key, value in cache.gpu_cache:
        assert torch.isnan(key[24:]).all() and torch.isnan(value[24:]).all()


def test_touched_blocks_are_never_zeroed_again():
    cache = make_cache()
    cache.prepare_write(1)
    cache.gpu_cache[0][0][1].fill_(7.0)  # a KV write
    cache.prepare_write(1)
    cache.prepare_write(30)
    assert (cache.gpu_cache[0][0][1] == 7.0).all()


def test_last_chunk_stops_at_the_end_of_the_cache():
    cache = make_cache()
    cache.prepare_write(BLOCKS - 1)
    assert cache.touched_blocks == BLOCKS and zeroed_blocks(cache) == list(range(BLOCKS))
    cache.prepare_slots(torch.tensor([BLOCKS * BLOCK_SIZE - 1]))  # no-op now
    assert cache.touched_blocks == BLOCKS


def test_swap_in_and_copy_prepare_their_destination_blocks():
    cache = make_cache()
    for key, value in cache.cpu_cache:
        key[3].fill_(5.0)
        value[3].fill_(6.0)
    cache.swap_in({3: 10})
    assert cache.touched_blocks == 16
    assert (cache.gpu_cache[0][0][10] == 5.0).all() and (cache.gpu_cache[1][1][10] == 6.0).all()
    cache.copy({10: [30]})
    assert cache.touched_blocks == 36 and (cache.gpu_cache[1][0][30] == 5.0).all()
    assert zeroed_blocks(cache) == [b for b in range(36) if b not in (10, 30)]


def test_cpu_cache_is_on_huge_page_aligned_mappings_of_its_own():
    cache = make_cache()
    tensors = [t for pair in cache.gpu_cache for t in pair]
    assert all(t.is_contiguous() and t.shape == (BLOCKS, BLOCK_SIZE, 2, 8) for t in tensors)
    assert all(t.data_ptr() % HUGE_PAGE == 0 for t in tensors)
    assert len({t.data_ptr() for t in tensors}) == len(tensors)


def test_huge_page_tensor_is_usable_memory_of_the_requested_size():
    t = huge_page_empty((3, 5), torch.bfloat16)
    t.fill_(1.5)
    assert t.dtype == torch.bfloat16 and t.shape == (3, 5) and float(t.sum()) == 22.5
