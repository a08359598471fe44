"""This stage's paged KV cache (its own layers only) plus the host swap space, and the block
operations the scheduler asks for: swap in, swap out, copy (copy-on-write).

With stage-local recovery on, a non-last stage also keeps its boundary cache: per KV slot, the
row it sent downstream for that token (its TP slice), paged with the KV blocks and moved by the
same block operations, so a replaced next stage can be rebuilt from it."""

from __future__ import annotations

import torch

from vllm.model_executor.layers.attention import KVCache
from vllm.worker.cpu_memory import huge_page_empty


def cache_block_bytes(
    block_size: int, num_kv_heads: int, head_size: int, num_layers: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across this stage's layers (keys and values)."""
    return layers_block_bytes(block_size, [(num_kv_heads, head_size)] * num_layers, dtype)


def layers_block_bytes(
    block_size: int, layer_shapes: list[tuple[int, int]], dtype: torch.dtype
) -> int:
    """Bytes one block takes across layers of their own (KV heads, head size) each."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    return sum(2 * block_size * heads * size * element_size for heads, size in layer_shapes)


class CacheEngine:
    """Owns the device cache and the swap space of one stage.

    Each layer's cache is a (key, value) pair of [num_blocks, block_size, num_kv_heads,
    head_size] tensors. The device cache may hold anything where nothing was written yet
    (torch.empty on CUDA): attention never reads a slot before writing it except in masked
    positions, which it zeroes out.

    On CPU the device cache lives on 2 MiB huge pages (worker/cpu_memory.py), and `reserve`
    zeroes it ahead of use: every step brings the scheduler's bound on the blocks its admitted
    requests can reach (Scheduler.kv_blocks_bound), so the pages are mapped in the step that
    admits the requests (a prefill, long anyway), never inside the decode loop. Left to fault
    in on first write, each decode step wrote one token into a few fresh blocks and took their
    page faults inside the attention layers (slow in a VM, where the host backs each page too):
    up to 15% of a late decode step. Zeroing the whole cache up front (vLLM V1's torch.zeros)
    cost 4-12 s of start-up per 4 GiB stage on the same VM, mostly for memory a run never used.
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
        layer_shapes: list[tuple[int, int]] | None = None,
        boundary_width: int = 0,
    ) -> None:
        """`layer_shapes`: (KV heads, head size) of each layer, when they differ between
        layers; else every layer has `num_kv_heads` x `head_size`. `boundary_width`: the
        width of the row this stage sends downstream per token (0: no boundary cache)."""
        self.device = device
        self.num_gpu_blocks = num_gpu_blocks
        # Blocks [0, reserved_blocks) of the device cache are mapped (all of them off CPU).
        self.reserved_blocks = 0 if device.type == "cpu" else num_gpu_blocks
        if layer_shapes is None:
            layer_shapes = [(num_kv_heads, head_size)] * num_layers
        if len(layer_shapes) != num_layers:
            raise ValueError(
                f"layer_shapes has {len(layer_shapes)} entries for {num_layers} layers."
            )

        def device_tensor(shape: tuple[int, ...]) -> torch.Tensor:
            if device.type == "cpu":
                return huge_page_empty(shape, dtype)
            return torch.empty(shape, dtype=dtype, device=device)

        # Pinned host memory makes CUDA swaps asynchronous; plain memory on CPU.
        pin = device.type == "cuda"
        self.gpu_cache: list[KVCache] = []
        self.cpu_cache: list[KVCache] = []
        for heads, size in layer_shapes:
            shape = (num_gpu_blocks, block_size, heads, size)
            self.gpu_cache.append((device_tensor(shape), device_tensor(shape)))
            host = (num_cpu_blocks, block_size, heads, size)
            self.cpu_cache.append(
                (
                    torch.empty(host, dtype=dtype, pin_memory=pin),
                    torch.empty(host, dtype=dtype, pin_memory=pin),
                )
            )
        # The boundary cache: [num_blocks, block_size, W] on the device and the host.
        self.gpu_boundary: torch.Tensor | None = None
        self.cpu_boundary: torch.Tensor | None = None
        if boundary_width > 0:
            self.gpu_boundary = device_tensor((num_gpu_blocks, block_size, boundary_width))
            self.cpu_boundary = torch.empty(
                (num_cpu_blocks, block_size, boundary_width), dtype=dtype, pin_memory=pin
            )

    def _device_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return huge_page_empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def add_layers(
        self,
        layer_shapes: list[tuple[int, int]],
        before: bool,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
    ) -> list[KVCache]:
        """This stage took over a lost neighbour's layers (a shrink): new KV tensors, device
        and host, for `layer_shapes` (placed before this stage's own layers
        when `before`, else after), and every tensor at `num_gpu_blocks` / `num_cpu_blocks`
        blocks. The first device blocks of the tensors kept (its own layers' KV and boundary
        rows) are kept; none may be in use above the new counts. The swap space must hold
        nothing in use when its count shrinks. Returns the new layers' device caches
        (garbage until written)."""
        if num_gpu_blocks > self.num_gpu_blocks or num_cpu_blocks > self._num_cpu_blocks():
            raise ValueError(
                f"num_gpu_blocks/num_cpu_blocks may only shrink ({self.num_gpu_blocks}, "
                f"{self._num_cpu_blocks()}), got ({num_gpu_blocks}, {num_cpu_blocks})."
            )
        sample = self._device_tensors()[0]
        dtype, block_size = sample.dtype, sample.shape[1]
        pin = self.device.type == "cuda"
        if num_gpu_blocks < self.num_gpu_blocks or num_cpu_blocks < self._num_cpu_blocks():
            self._shrink(num_gpu_blocks, num_cpu_blocks)
        gained_gpu: list[KVCache] = []
        gained_cpu: list[KVCache] = []
        for heads, size in layer_shapes:
            shape = (num_gpu_blocks, block_size, heads, size)
            pair = (self._device_tensor(shape, dtype), self._device_tensor(shape, dtype))
            for tensor in pair:
                # The blocks the kept tensors have mapped (`reserve`): mapped here too, and
                # never garbage where attention masks.
                tensor[: self.reserved_blocks].zero_()
            gained_gpu.append(pair)
            host = (num_cpu_blocks, block_size, heads, size)
            gained_cpu.append(
                (
                    torch.empty(host, dtype=dtype, pin_memory=pin),
                    torch.empty(host, dtype=dtype, pin_memory=pin),
                )
            )
        if before:
            self.gpu_cache = gained_gpu + self.gpu_cache
            self.cpu_cache = gained_cpu + self.cpu_cache
        else:
            self.gpu_cache = self.gpu_cache + gained_gpu
            self.cpu_cache = self.cpu_cache + gained_cpu
        return gained_gpu

    def _num_cpu_blocks(self) -> int:
        return self._host_tensors()[0].shape[0] if self._host_tensors() else 0

    def _shrink(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The tensors of a device whose count shrinks, cut to their first blocks in tensors
        of that size (the memory of the larger ones is given back). Device blocks are copied
        as far as they are mapped (the rest holds nothing yet); host blocks are not: every
        swapped group was swapped in before (`vllm.resilience.plans.shrink`), so the swap
        space holds nothing in use."""
        copied = min(self.reserved_blocks, num_gpu_blocks)

        def on_device(tensor: torch.Tensor) -> torch.Tensor:
            new = self._device_tensor((num_gpu_blocks, *tensor.shape[1:]), tensor.dtype)
            new[:copied].copy_(tensor[:copied])
            return new

        def on_host(tensor: torch.Tensor) -> torch.Tensor:
            shape = (num_cpu_blocks, *tensor.shape[1:])
            return torch.empty(shape, dtype=tensor.dtype, pin_memory=self.device.type == "cuda")

        if num_gpu_blocks < self.num_gpu_blocks:
            self.gpu_cache = [(on_device(k), on_device(v)) for k, v in self.gpu_cache]
            if self.gpu_boundary is not None:
                self.gpu_boundary = on_device(self.gpu_boundary)
            self.num_gpu_blocks = num_gpu_blocks
            self.reserved_blocks = copied
        if num_cpu_blocks < self._num_cpu_blocks():
            self.cpu_cache = [(on_host(k), on_host(v)) for k, v in self.cpu_cache]
            if self.cpu_boundary is not None:
                self.cpu_boundary = on_host(self.cpu_boundary)

    def empty_boundary(self) -> torch.Tensor:
        """A device tensor shaped like the boundary cache, uninitialised."""
        assert self.gpu_boundary is not None, "no boundary cache on this stage"
        return self._device_tensor(tuple(self.gpu_boundary.shape), self.gpu_boundary.dtype)

    def drop_boundary(self) -> None:
        """This stage became the last one: it sends nothing downstream, so it keeps no
        boundary rows."""
        self.gpu_boundary = None
        self.cpu_boundary = None

    def _device_tensors(self) -> list[torch.Tensor]:
        """Every paged device tensor: each layer's keys and values, then the boundary."""
        tensors = [t for pair in self.gpu_cache for t in pair]
        return tensors + ([self.gpu_boundary] if self.gpu_boundary is not None else [])

    def _host_tensors(self) -> list[torch.Tensor]:
        """The host counterparts of `_device_tensors`, in the same order."""
        tensors = [t for pair in self.cpu_cache for t in pair]
        return tensors + ([self.cpu_boundary] if self.cpu_boundary is not None else [])

    def write_boundary(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep `rows` [T, W] (what this stage sent downstream) at KV `slots` [T]."""
        assert self.gpu_boundary is not None, "no boundary cache on this stage"
        flat = self.gpu_boundary.view(-1, self.gpu_boundary.shape[-1])  # [blocks*bs, W]
        flat.index_copy_(0, slots.to(flat.device), rows.to(flat.dtype))

    def read_boundary(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows [T, W] kept at KV `slots` [T]."""
        assert self.gpu_boundary is not None, "no boundary cache on this stage"
        flat = self.gpu_boundary.view(-1, self.gpu_boundary.shape[-1])  # [blocks*bs, W]
        return flat.index_select(0, slots.to(flat.device))

    def reserve(self, num_blocks: int) -> None:
        """Map (by zeroing) the device blocks below `num_blocks` not mapped yet (CPU only)."""
        end = min(num_blocks, self.num_gpu_blocks)
        if end <= self.reserved_blocks:
            return
        for tensor in self._device_tensors():
            tensor[self.reserved_blocks : end].zero_()
        self.reserved_blocks = end

    @staticmethod
    def _copy_blocks(
        src: list[torch.Tensor], dst: list[torch.Tensor], mapping: dict[int, int]
    ) -> None:
        if not mapping:
            return
        src_idx = torch.tensor(list(mapping.keys()), dtype=torch.long)
        dst_idx = torch.tensor(list(mapping.values()), dtype=torch.long)
        for src_t, dst_t in zip(src, dst, strict=True):
            s = src_idx.to(src_t.device)
            d = dst_idx.to(dst_t.device)
            dst_t.index_copy_(0, d, src_t.index_select(0, s).to(dst_t.device, non_blocking=True))

    def swap_in(self, mapping: dict[int, int]) -> None:
        """Host blocks -> device blocks (mapping: cpu block -> gpu block)."""
        self._copy_blocks(self._host_tensors(), self._device_tensors(), mapping)

    def swap_out(self, mapping: dict[int, int]) -> None:
        """Device blocks -> host blocks (mapping: gpu block -> cpu block)."""
        self._copy_blocks(self._device_tensors(), self._host_tensors(), mapping)

    def copy(self, mapping: dict[int, list[int]]) -> None:
        """Copy-on-write within the device cache (mapping: src block -> [dst blocks])."""
        pairs = {dst: src for src, dsts in mapping.items() for dst in dsts}
        if not pairs:
            return
        src_idx = torch.tensor(list(pairs.values()), dtype=torch.long, device=self.device)
        dst_idx = torch.tensor(list(pairs.keys()), dtype=torch.long, device=self.device)
        for tensor in self._device_tensors():
            tensor.index_copy_(0, dst_idx, tensor.index_select(0, src_idx))
