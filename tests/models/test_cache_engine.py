"""The CPU device cache: on huge-page-aligned mappings of its own, mapped (zeroed) ahead of use
up to the bound each step brings (`reserve`), never twice; the swap and copy operations still
move blocks between and within the caches."""

from __future__ import annotations

import torch

from vllm.worker.cache_engine import CacheEngine
from vllm.worker.cpu_memory import HUGE_PAGE, huge_page_empty

BLOCKS, BLOCK_SIZE = 64, 4


def make_cache() -> CacheEngine:
    return CacheEngine(2, 2, 8, BLOCK_SIZE, BLOCKS, 8, torch.float32, torch.device("cpu"))


def zeroed_blocks(cache: CacheEngine) -> list[int]:
    key = cache.gpu_cache[1][1]
    return [b for b in range(BLOCKS) if bool((key[b] == 0).all())]


def test_reserve_zeroes_up_to_the_bound_once():
    cache = make_cache()
    assert cache.reserved_blocks == 0
    for key, value in cache.gpu_cache:  # what unmapped memory may hold once reused: garbage
        key.fill_(float("nan"))
        value.fill_(float("nan"))
    cache.reserve(10)
    assert cache.reserved_blocks == 10 and zeroed_blocks(cache) == list(range(10))
    cache.gpu_cache[1][1][3].fill_(7.0)  # a KV write
    cache.reserve(10)
    cache.reserve(4)  # a lower bound later (requests finished): nothing to do
    cache.reserve(20)
    assert (cache.gpu_cache[1][1][3] == 7.0).all()
    assert zeroed_blocks(cache) == [b for b in range(20) if b != 3]
    assert torch.isnan(cache.gpu_cache[0][0][20:]).all()
    cache.reserve(10 * BLOCKS)  # capped at the cache
    assert cache.reserved_blocks == BLOCKS and len(zeroed_blocks(cache)) == BLOCKS - 1


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


def test_swap_in_out_and_copy_move_whole_blocks():
    cache = make_cache()
    for layer, (key, value) in enumerate(cache.gpu_cache):
        key[5].fill_(1.0 + layer)
        value[5].fill_(-1.0 - layer)
    cache.swap_out({5: 2})
    cache.swap_in({2: 40})
    cache.copy({40: [41, 63]})
    for layer, (key, value) in enumerate(cache.gpu_cache):
        for block in (40, 41, 63):
            assert (key[block] == 1.0 + layer).all() and (value[block] == -1.0 - layer).all()
        assert (key[6] == 0).all() and (key[39] == 0).all()


def test_boundary_cache_moves_with_its_blocks():
    """The boundary rows are written and read per KV slot, and swap out / swap in / copy move
    them with their blocks like a KV layer."""
    width = 6
    cache = CacheEngine(
        2, 2, 8, BLOCK_SIZE, BLOCKS, 8, torch.float32, torch.device("cpu"), boundary_width=width
    )
    no_boundary = make_cache()
    assert no_boundary.gpu_boundary is None
    slots = torch.tensor([5 * BLOCK_SIZE + 1, 5 * BLOCK_SIZE + 3, 9 * BLOCK_SIZE])
    rows = torch.arange(3 * width, dtype=torch.float32).view(3, width)  # [T, W]
    cache.write_boundary(slots, rows)
    assert torch.equal(cache.read_boundary(slots), rows)
    cache.swap_out({5: 2, 9: 3})
    cache.write_boundary(slots, torch.zeros(3, width))  # the device blocks reused meanwhile
    cache.swap_in({2: 11, 3: 12})
    moved = torch.tensor([11 * BLOCK_SIZE + 1, 11 * BLOCK_SIZE + 3, 12 * BLOCK_SIZE])
    assert torch.equal(cache.read_boundary(moved), rows)
    cache.copy({11: [20]})  # copy-on-write
    copied = torch.tensor([20 * BLOCK_SIZE + 1, 20 * BLOCK_SIZE + 3])
    assert torch.equal(cache.read_boundary(copied), rows[:2])


def test_a_rank_that_left_its_groups_still_applies_a_steps_block_operations():
    """A step queued behind one this rank failed raises (the engine re-forms the groups), but
    first moves the blocks it names: every survivor then holds what the scheduler's block
    tables say, so a stage-local rebuild trusts them."""
    from types import SimpleNamespace

    import pytest

    from vllm.config import ParallelConfig
    from vllm.step_records import ExecuteModelRequest
    from vllm.worker.worker import Worker

    cache = make_cache()
    cache.reserve(BLOCKS)
    key, value = cache.gpu_cache[0]
    key[5].fill_(5.0)
    value[6].fill_(6.0)
    rank = SimpleNamespace(
        cache_engine=cache,
        rank=1,
        parallel_config=ParallelConfig(2, distributed_executor_backend="mp"),
    )
    rank.apply_block_ops = lambda bound, ops: Worker.apply_block_ops(rank, bound, ops)
    request = ExecuteModelRequest(
        step=None, blocks_to_swap_out={6: 2}, blocks_to_copy={5: [9]}, kv_blocks_bound=BLOCKS
    )
    with pytest.raises(RuntimeError, match="left its process groups"):
        Worker.execute_model(rank, request)  # type: ignore[arg-type]
    assert (key[9] == 5.0).all() and (cache.cpu_cache[0][1][2] == 6.0).all()


def test_add_layers_keeps_the_mapped_blocks_and_shrinks_the_pools():
    """A stage taking over a lost neighbour's layers: its own layers' KV and boundary rows
    stay (the mapped blocks below the new count), the gained layers get tensors of their
    own, before or after its own, and both pools shrink to the counts given."""
    cache = CacheEngine(
        2, 2, 8, BLOCK_SIZE, BLOCKS, 8, torch.float32, torch.device("cpu"), boundary_width=16
    )
    cache.reserve(20)
    for layer, (key, value) in enumerate(cache.gpu_cache):
        key[3].fill_(1.0 + layer)
        value[3].fill_(-1.0 - layer)
    assert cache.gpu_boundary is not None
    cache.gpu_boundary[3].fill_(9.0)
    gained = cache.add_layers([(1, 16)], before=False, num_gpu_blocks=32, num_cpu_blocks=4)
    assert len(cache.gpu_cache) == len(cache.cpu_cache) == 3
    assert cache.gpu_cache[2] is gained[0]
    assert gained[0][0].shape == (32, BLOCK_SIZE, 1, 16)
    assert cache.cpu_cache[2][0].shape == (4, BLOCK_SIZE, 1, 16)
    assert all(t.shape[0] == 32 for pair in cache.gpu_cache for t in pair)
    assert all(t.shape[0] == 4 for pair in cache.cpu_cache for t in pair)
    assert (cache.gpu_cache[0][0][3] == 1.0).all() and (cache.gpu_cache[1][1][3] == -2.0).all()
    assert (cache.gpu_boundary[3] == 9.0).all() and cache.gpu_boundary.shape[0] == 32
    assert (gained[0][0][:20] == 0).all()  # mapped as far as the kept tensors are
    assert cache.num_gpu_blocks == 32 and cache.reserved_blocks == 20
    before = cache.add_layers([(2, 8)], before=True, num_gpu_blocks=32, num_cpu_blocks=4)
    assert cache.gpu_cache[0] is before[0] and len(cache.gpu_cache) == 4
    cache.drop_boundary()
    assert cache.gpu_boundary is None and cache.cpu_boundary is None
