"""Paged KV-cache bookkeeping: which physical blocks hold which sequence's tokens.

Physical blocks are plain ints 0..N-1 per device (the same numbers on every pipeline stage: each
stage owns the KV of its own layers for every block). Sequences of one group share blocks until
they diverge (copy-on-write). Imports no torch.
"""

from __future__ import annotations

import enum
import heapq
import math
from typing import TYPE_CHECKING

from vllm.sequence import SequenceStatus

if TYPE_CHECKING:
    from vllm.sequence import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    """Whether a group's prompt fits now (OK), after others free blocks (LATER), or never."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


class _BlockAllocator:
    """Free list and reference counts of one device's blocks.

    The lowest free number is handed out first so block tables are deterministic and easy to
    read in tests and logs.
    """

    def __init__(self, device: str, num_blocks: int) -> None:
        self.device = device
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks))  # already a valid heap

    def allocate(self) -> int:
        if not self._free:
            raise ValueError(f"Out of memory! No free {self.device} blocks are available.")
        block = heapq.heappop(self._free)
        self._ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        self._check(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"Cannot share free {self.device} block {block}.")
        self._ref_counts[block] += 1

    def free(self, block: int) -> None:
        self._check(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"Double free! {self.device} block {block} is already freed.")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            heapq.heappush(self._free, block)

    def ref_count(self, block: int) -> int:
        self._check(block)
        return self._ref_counts[block]

    def num_free(self) -> int:
        return len(self._free)

    def _check(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"Unknown {self.device} block {block!r} (have {self.num_blocks}).")


class BlockSpaceManager:
    """Paged KV blocks: block tables per sequence, reference counts, copy-on-write fork,
    append, free, swap.

    A sequence's table lives either on the GPU (running) or on the CPU (swapped out), never both.
    """

    def __init__(
        self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, watermark: float = 0.01
    ) -> None:
        if watermark < 0:
            raise ValueError(f"watermark must be non-negative, got {watermark}.")
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark = watermark
        # Kept free on admission so running sequences can still grow without instant preemption.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.reset()

    def reset(self) -> None:
        """Forget every table and mark all blocks of both devices free."""
        self._gpu = _BlockAllocator("gpu", self.num_total_gpu_blocks)
        self._cpu = _BlockAllocator("cpu", self.num_total_cpu_blocks)
        self._gpu_tables: dict[int, list[int]] = {}
        self._cpu_tables: dict[int, list[int]] = {}

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # -- admission -------------------------------------------------------------------------

    def _prompt_sets(self, seq_group: SequenceGroup) -> list[list[Sequence]]:
        """The group's WAITING sequences, grouped by identical token lists.

        A new request's sequences share one prompt, so they share one set of blocks. After a
        recompute (a lost stage, an interrupt) the samples of a group have diverged and each
        needs blocks of its own."""
        sets: dict[tuple[int, ...], list[Sequence]] = {}
        for seq in seq_group.get_seqs(status=SequenceStatus.WAITING):
            sets.setdefault(tuple(seq.get_token_ids()), []).append(seq)
        return list(sets.values())

    def _blocks_to_allocate(self, seq_group: SequenceGroup) -> int:
        return sum(self._blocks_for(seqs[0].get_len()) for seqs in self._prompt_sets(seq_group))

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        """Whether the group's WAITING sequences fit (one copy per distinct token list)."""
        required = self._blocks_to_allocate(seq_group)
        if self.num_total_gpu_blocks - required < self.watermark_blocks:
            return AllocStatus.NEVER
        if self._gpu.num_free() - required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Give the group's WAITING sequences blocks for their tokens, one shared set per
        distinct token list."""
        num_blocks = self._blocks_to_allocate(seq_group)
        if num_blocks > self._gpu.num_free():
            # Checked up front so a failed allocation leaks no blocks.
            raise ValueError(
                f"Out of memory! Need {num_blocks} gpu blocks, {self._gpu.num_free()} free."
            )
        for seqs in self._prompt_sets(seq_group):
            table = [self._gpu.allocate() for _ in range(self._blocks_for(seqs[0].get_len()))]
            for block in table:
                for _ in seqs[1:]:
                    self._gpu.incref(block)
            for seq in seqs:
                self._gpu_tables[seq.seq_id] = list(table)

    # -- decode growth ---------------------------------------------------------------------

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Conservative: every RUNNING sequence may need a fresh block for its next token."""
        return self._gpu.num_free() >= seq_group.num_seqs(status=SequenceStatus.RUNNING)

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Make room for the token at position `seq.get_len() - 1`.

        Returns the copy-on-write pairs (src, dst) the workers must copy before writing.
        """
        table = self._gpu_tables[seq.seq_id]
        needed = self._blocks_for(seq.get_len())
        if len(table) < needed:
            # The new token starts a block of its own, so nothing shared is written.
            while len(table) < needed:
                table.append(self._gpu.allocate())
            return []
        last = table[-1]
        if self._gpu.ref_count(last) == 1:
            return []
        # The last block is shared with a forked sibling: write into a private copy.
        new_block = self._gpu.allocate()
        table[-1] = new_block
        self._gpu.free(last)
        return [(last, new_block)]

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares all of the parent's blocks until one of them writes."""
        table = self._gpu_tables[parent_seq.seq_id]
        for block in table:
            self._gpu.incref(block)
        self._gpu_tables[child_seq.seq_id] = list(table)

    # -- swapping --------------------------------------------------------------------------

    def _unique_blocks(self, seqs: list[Sequence], tables: dict[int, list[int]]) -> set[int]:
        blocks: set[int] = set()
        for seq in seqs:
            blocks.update(tables.get(seq.seq_id, ()))
        return blocks

    def can_swap_in(self, seq_group: SequenceGroup) -> bool:
        """Room for the group's swapped blocks plus one new block per sequence (next token)."""
        seqs = seq_group.get_seqs(status=SequenceStatus.SWAPPED)
        required = len(self._unique_blocks(seqs, self._cpu_tables)) + len(seqs)
        return self._gpu.num_free() - required >= self.watermark_blocks

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the SWAPPED sequences' blocks to the GPU; returns {cpu block: gpu block}."""
        seqs = seq_group.get_seqs(status=SequenceStatus.SWAPPED)
        return self._move(seqs, self._cpu_tables, self._cpu, self._gpu_tables, self._gpu)

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        """Whether the CPU has room for the RUNNING sequences' (shared-once) blocks."""
        seqs = seq_group.get_seqs(status=SequenceStatus.RUNNING)
        return len(self._unique_blocks(seqs, self._gpu_tables)) <= self._cpu.num_free()

    def swap_out(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the RUNNING sequences' blocks to the CPU; returns {gpu block: cpu block}."""
        seqs = seq_group.get_seqs(status=SequenceStatus.RUNNING)
        return self._move(seqs, self._gpu_tables, self._gpu, self._cpu_tables, self._cpu)

    def _move(
        self,
        seqs: list[Sequence],
        src_tables: dict[int, list[int]],
        src: _BlockAllocator,
        dst_tables: dict[int, list[int]],
        dst: _BlockAllocator,
    ) -> dict[int, int]:
        # A block shared by several sequences is copied once and stays shared on the other side.
        mapping: dict[int, int] = {}
        for seq in seqs:
            new_table = []
            for block in src_tables.pop(seq.seq_id):
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                new_table.append(mapping[block])
                src.free(block)
            dst_tables[seq.seq_id] = new_table
        return mapping

    # -- release and queries ---------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references to its blocks (no-op if it holds none)."""
        for tables, allocator in ((self._gpu_tables, self._gpu), (self._cpu_tables, self._cpu)):
            table = tables.pop(seq.seq_id, None)
            if table is not None:
                for block in table:
                    allocator.free(block)

    def get_block_table(self, seq: Sequence) -> list[int]:
        """Physical block numbers of the sequence, in token order (on its current device)."""
        table = self._gpu_tables.get(seq.seq_id)
        if table is None:
            table = self._cpu_tables[seq.seq_id]
        return list(table)

    def get_num_free_gpu_blocks(self) -> int:
        """Free device (GPU, or the CPU KV cache on CPU runs) blocks."""
        return self._gpu.num_free()

    def get_num_free_cpu_blocks(self) -> int:
        """Free swap-space blocks."""
        return self._cpu.num_free()
