"""This stage's paged KV cache (its own layers only) plus the host swap space, and the block
operations the scheduler asks for: swap in, swap out, copy (copy-on-write)."""

from __future__ import annotations

import torch

from vllm.model_executor.layers.attention import KVCache
from vllm.worker.cpu_memory import huge_page_empty


def cache_block_bytes(
    block_size: int, num_kv_heads: int, head_size: int, num_layers: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across this stage's layers (keys and values)."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    return 2 * block_size * num_kv_heads * head_size * num_layers * element_size


class CacheEngine:
    """Owns the device cache and the swap space of one stage.

    Each layer's cache is a (key, value) pair of [num_blocks, block_size, num_kv_heads,
    head_size] tensors. The device cache is allocated with torch.empty: attention never reads a
    slot before writing it except in masked positions, which it zeroes out.

    On CPU the memory behind torch.empty is only mapped when first written. A decode step
    writes one token to each of a few fresh blocks, so the page faults (slow in a VM: the host
    backs the page too) came one 4 KiB page at a time inside the attention layers, costing up
    to 15% of a late decode step. `prepare_write` instead zeroes blocks ahead of use in large
    sequential chunks (the block manager hands out the lowest free block first, so the used
    blocks stay at the front), one chunk ahead of the highest block in use, and the cost moves
    out of the hot loop without touching memory the workload never needs. The CPU device cache
    lives on huge pages (worker/cpu_memory.py).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        # Blocks [0, touched_blocks) of the device cache have been written at least once.
        self.touched_blocks = num_gpu_blocks if device.type != "cpu" else 0
        self._touch_chunk = max(1, num_gpu_blocks // 16)
        shape = (num_gpu_blocks, block_size, num_kv_heads, head_size)

        def empty() -> torch.Tensor:
            if device.type == "cpu":
                return huge_page_empty(shape, dtype)
            return torch.empty(shape, dtype=dtype, device=device)

        self.gpu_cache: list[KVCache] = [(empty(), empty()) for _ in range(num_layers)]
        # Pinned host memory makes CUDA swaps asynchronous; plain memory on CPU.
        pin = device.type == "cuda"
        self.cpu_cache: list[KVCache] = [
            (
                torch.empty((num_cpu_blocks, *shape[1:]), dtype=dtype, pin_memory=pin),
                torch.empty((num_cpu_blocks, *shape[1:]), dtype=dtype, pin_memory=pin),
            )
            for _ in range(num_layers)
        ]

    def prepare_write(self, last_block: int) -> None:
        """Make sure blocks up to `last_block` have been touched before a write lands there:
        zero the untouched ones up to the next chunk boundary (see the class docstring)."""
        if last_block < self.touched_blocks:
            return
        # One chunk of headroom: a cache that grows a block at a time (decode) then meets a
        # zeroing step only once per chunk, not at every chunk boundary it crosses.
        chunks = last_block // self._touch_chunk + 2
        end = min(self.num_gpu_blocks, chunks * self._touch_chunk)
        for key_cache, value_cache in self.gpu_cache:
            key_cache[self.touched_blocks : end].zero_()
            value_cache[self.touched_blocks : end].zero_()
        self.touched_blocks = end

    def prepare_slots(self, slot_mapping: torch.Tensor) -> None:
        """`prepare_write` for a step's KV writes (flat slots; -1 marks padding)."""
        if self.touched_blocks < self.num_gpu_blocks and slot_mapping.numel():
            self.prepare_write(int(slot_mapping.max()) // self.block_size)

    @staticmethod
    def _copy_blocks(
        src: list[KVCache], dst: list[KVCache], mapping: dict[int, int], device: torch.device
    ) -> None:
        if not mapping:
            return
        src_idx = torch.tensor(list(mapping.keys()), dtype=torch.long)
        dst_idx = torch.tensor(list(mapping.values()), dtype=torch.long)
        for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
            s = src_idx.to(src_k.device)
            d = dst_idx.to(dst_k.device)
            dst_k.index_copy_(0, d, src_k.index_select(0, s).to(dst_k.device, non_blocking=True))
            dst_v.index_copy_(0, d, src_v.index_select(0, s).to(dst_v.device, non_blocking=True))

    def swap_in(self, mapping: dict[int, int]) -> None:
        """Host blocks -> device blocks (mapping: cpu block -> gpu block)."""
        if mapping:
            self.prepare_write(max(mapping.values()))
        self._copy_blocks(self.cpu_cache, self.gpu_cache, mapping, self.device)

    def swap_out(self, mapping: dict[int, int]) -> None:
        """Device blocks -> host blocks (mapping: gpu block -> cpu block)."""
        self._copy_blocks(self.gpu_cache, self.cpu_cache, mapping, self.device)

    def copy(self, mapping: dict[int, list[int]]) -> None:
        """Copy-on-write within the device cache (mapping: src block -> [dst blocks])."""
        pairs = {dst: src for src, dsts in mapping.items() for dst in dsts}
        if not pairs:
            return
        self.prepare_write(max(pairs))
        src_idx = torch.tensor(list(pairs.values()), dtype=torch.long, device=self.device)
        dst_idx = torch.tensor(list(pairs.keys()), dtype=torch.long, device=self.device)
        for key_cache, value_cache in self.gpu_cache:
            key_cache.index_copy_(0, dst_idx, key_cache.index_select(0, src_idx))
            value_cache.index_copy_(0, dst_idx, value_cache.index_select(0, src_idx))
