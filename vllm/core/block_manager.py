"""Paged KV-cache bookkeeping: which physical blocks hold which sequence's tokens.

Physical blocks are plain ints 0..N-1 per device (the same numbers on every pipeline stage: each
stage owns the KV of its own layers for every block). Sequences of one group share blocks until
they diverge (copy-on-write). Imports no torch.
"""

from __future__ import annotations

import collections
import enum
import heapq
import itertools
import math
from typing import TYPE_CHECKING, Callable

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
    read in tests and logs. With prefix caching, a block whose last reference goes away while
    it holds cached KV (`cached` says which) is not freed but parked in an LRU evictor: it can
    be revived by a later request with the same prefix, and is reused for other data only when
    no never-used or plain free block is left (least recently freed first).
    """

    def __init__(self, device: str, num_blocks: int) -> None:
        self.device = device
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks))  # already a valid heap
        # Free blocks that still hold cached KV, least recently freed first.
        self.evictor: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Called with a block taken out of the evictor for other data (forget its hash).
        self.on_evict: Callable[[int], None] | None = None
        # Called when a block's last reference is dropped: True parks it in the evictor.
        self.keep_cached: Callable[[int], bool] | None = None
        # One past the highest block ever handed out: no block in use reaches it.
        self.high_water = 0

    def allocate(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        elif self.evictor:
            block, _ = self.evictor.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block)
        else:
            raise ValueError(f"Out of memory! No free {self.device} blocks are available.")
        self._ref_counts[block] = 1
        self.high_water = max(self.high_water, block + 1)
        return block

    def incref(self, block: int) -> None:
        self._check(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"Cannot share free {self.device} block {block}.")
        self._ref_counts[block] += 1

    def revive(self, block: int) -> None:
        """Take a reference on a cached block, in use or parked in the evictor."""
        self._check(block)
        if self._ref_counts[block] == 0:
            del self.evictor[block]
        self._ref_counts[block] += 1

    def free(self, block: int) -> None:
        self._check(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"Double free! {self.device} block {block} is already freed.")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if self.keep_cached is not None and self.keep_cached(block):
                self.evictor[block] = None
            else:
                heapq.heappush(self._free, block)

    def drop_evictor(self) -> None:
        """Return every parked block to the free list."""
        while self.evictor:
            block, _ = self.evictor.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block)
            heapq.heappush(self._free, block)

    def first_in_use_from(self, num_blocks: int) -> int | None:
        """The lowest block at or above `num_blocks` that is referenced (None: none is)."""
        return next(
            (b for b in range(num_blocks, self.num_blocks) if self._ref_counts[b] > 0), None
        )

    def truncate(self, num_blocks: int) -> None:
        """Keep blocks [0, num_blocks) only; none above may be referenced (parked ones are
        forgotten)."""
        assert self.first_in_use_from(num_blocks) is None, "a block in use would be lost"
        for block in [b for b in self.evictor if b >= num_blocks]:
            del self.evictor[block]
            if self.on_evict is not None:
                self.on_evict(block)
        self._free = [b for b in self._free if b < num_blocks]
        heapq.heapify(self._free)
        del self._ref_counts[num_blocks:]
        self.num_blocks = num_blocks
        self.high_water = min(self.high_water, num_blocks)

    def ref_count(self, block: int) -> int:
        self._check(block)
        return self._ref_counts[block]

    def num_free(self) -> int:
        """Blocks available for new data: never used, freed, or cached but unreferenced."""
        return len(self._free) + len(self.evictor)

    def _check(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"Unknown {self.device} block {block!r} (have {self.num_blocks}).")


class BlockSpaceManager:
    """Paged KV blocks: block tables per sequence, reference counts, copy-on-write fork,
    append, free, swap, and (optional) automatic prefix caching.

    A sequence's table lives either on the GPU (running) or on the CPU (swapped out), never both.

    Prefix caching (vLLM's automatic prefix caching): a full block of a prompt is identified by
    hash((hash of the block before it, its token ids)), so equal hashes mean equal prefixes. A
    new prompt takes, instead of fresh blocks, the cached blocks of its longest cached full-block
    prefix whose KV is written ("computed", reported by the scheduler when the batch that wrote
    them returns), but never the block of its last token: at least one token is computed, and
    no shared block is ever written. Cached blocks nobody references wait in an LRU evictor and
    are reused for other data only when no plain free block is left. Block ids are the same on
    every pipeline stage, so every stage finds the cached KV of its own layers in them.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_caching: bool = False,
    ) -> None:
        if watermark < 0:
            raise ValueError(f"watermark must be non-negative, got {watermark}.")
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark = watermark
        self.enable_caching = enable_caching
        # Kept free on admission so running sequences can still grow without instant preemption.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        # Table epochs: a table gets a fresh number whenever an entry is written other than
        # by appending (allocate, fork, copy-on-write, swap), so the step writer knows when
        # the stages need a whole table rather than its new tail. Never restarts (not even
        # on reset), so an old number never names a new table.
        self._epochs = itertools.count(1)
        self.reset()

    def resize(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """New block counts (the stages' caches were re-made, e.g. after a layer re-split);
        forgets every table and cached block, like `reset`."""
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = int(self.watermark * num_gpu_blocks)
        self.reset()

    def shrink(self, num_gpu_blocks: int, num_cpu_blocks: int) -> str | None:
        """Fewer blocks, every table kept (a stage that took over more layers holds fewer):
        done when no block in use is at or above the new counts, else why not (nothing
        changes). ValueError naming the count when it would grow."""
        why = self.why_not_shrink(num_gpu_blocks, num_cpu_blocks)
        if why is not None:
            return why
        self._gpu.truncate(num_gpu_blocks)
        self._cpu.truncate(num_cpu_blocks)
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = int(self.watermark * num_gpu_blocks)
        return None

    def why_not_shrink(self, num_gpu_blocks: int, num_cpu_blocks: int) -> str | None:
        """Why `shrink` to these counts cannot keep every table (None: it can)."""
        counts = ((self._gpu, num_gpu_blocks, "num_gpu_blocks"),
                  (self._cpu, num_cpu_blocks, "num_cpu_blocks"))  # fmt: skip
        for allocator, count, name in counts:
            if not 0 <= count <= allocator.num_blocks:
                raise ValueError(f"{name} must be in [0, {allocator.num_blocks}], got {count}.")
            block = allocator.first_in_use_from(count)
            if block is not None:
                return f"{allocator.device} block {block} is in use, beyond {count} blocks"
        return None

    def reset(self) -> None:
        """Forget every table and cached block and mark all blocks of both devices free."""
        self._gpu = _BlockAllocator("gpu", self.num_total_gpu_blocks)
        self._cpu = _BlockAllocator("cpu", self.num_total_cpu_blocks)
        self._gpu_tables: dict[int, list[int]] = {}
        self._cpu_tables: dict[int, list[int]] = {}
        self._table_epochs: dict[int, int] = {}
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        self._computed: set[int] = set()
        self.num_queried_blocks = 0
        self.num_hit_blocks = 0
        if self.enable_caching:
            self._gpu.keep_cached = self._keep_cached
            self._gpu.on_evict = self._forget

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # -- prefix caching --------------------------------------------------------------------

    def _keep_cached(self, block: int) -> bool:
        if block in self._computed:
            return True
        # Registered but never written (its request was aborted or preempted first).
        self._forget(block)
        return False

    def _forget(self, block: int) -> None:
        block_hash = self._block_to_hash.pop(block, None)
        if block_hash is not None:
            del self._hash_to_block[block_hash]
        self._computed.discard(block)

    def _block_hashes(self, token_ids: list[int], lora_int_id: int = 0) -> list[int]:
        """hash((parent hash, block tokens)) of each full block of `token_ids`. The chain
        starts from the request's LoRA adapter id: the same tokens under two adapters (or an
        adapter and the base model) have different KV, and never share blocks."""
        size = self.block_size
        hashes: list[int] = []
        parent: int | None = lora_int_id or None
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash((parent, tuple(token_ids[start : start + size])))
            hashes.append(parent)
        return hashes

    def _cached_prefix(self, seq_group: SequenceGroup) -> tuple[list[int], list[int]]:
        """(hashes of the full blocks of the group's waiting prompt, the computed cached
        blocks of its leading full blocks, at most up to the block before its last token)."""
        if not self.enable_caching:
            return [], []
        prompt_sets = self._prompt_sets(seq_group)
        # Samples that diverged before a recompute get blocks of their own, uncached.
        if len(prompt_sets) != 1:
            return [], []
        tokens = prompt_sets[0][0].get_token_ids()
        hashes = self._block_hashes(tokens, getattr(seq_group, "lora_int_id", 0))
        hits: list[int] = []
        # Prompt logprobs need the logits of every prompt position, MEAN/ALL/STEP pooling the
        # hidden states of every prompt position: nothing may be skipped.
        if _reads_prefix_cache(seq_group):
            for block_hash in hashes[: (len(tokens) - 1) // self.block_size]:
                block = self._hash_to_block.get(block_hash)
                if block is None or block not in self._computed:
                    break
                hits.append(block)
        return hashes, hits

    def prefix_pending(self, seq_group: SequenceGroup) -> bool:
        """Whether the waiting prompt's next block after its cached prefix is being computed
        right now by another request (registered, KV not written yet): admitted later, the
        prompt reuses it instead of computing the same prefix a second time."""
        hashes, hits = self._cached_prefix(seq_group)
        waiting = seq_group.get_seqs(status=SequenceStatus.WAITING)
        if not hashes or not waiting:
            return False
        if not _reads_prefix_cache(seq_group):
            return False
        index = len(hits)
        if index >= (waiting[0].get_len() - 1) // self.block_size:
            return False
        block = self._hash_to_block.get(hashes[index])
        return block is not None and block not in self._computed

    def num_cached_tokens(self, seq_group: SequenceGroup) -> int:
        """Leading tokens of the waiting prompt whose KV `allocate` would take from the cache."""
        return len(self._cached_prefix(seq_group)[1]) * self.block_size

    def mark_blocks_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """The KV of the first `num_computed_tokens` tokens is written: their full blocks may
        now serve other requests."""
        if not self.enable_caching:
            return
        table = self._gpu_tables.get(seq.seq_id)
        if table is None:
            return
        for block in table[: num_computed_tokens // self.block_size]:
            if block in self._block_to_hash:
                self._computed.add(block)

    def get_prefix_cache_hit_rate(self) -> float:
        """Cached blocks found / full prompt blocks looked up, over all admissions (-1 when
        prefix caching is off, as vLLM reports)."""
        if not self.enable_caching:
            return -1.0
        if self.num_queried_blocks == 0:
            return 0.0
        return self.num_hit_blocks / self.num_queried_blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after a stage lost its KV): blocks in use stay
        with their sequences but are never shared again; parked blocks become plain free."""
        self._gpu.drop_evictor()
        self._hash_to_block.clear()
        self._block_to_hash.clear()
        self._computed.clear()

    def drop_free_cached_blocks(self) -> None:
        """Unreferenced cached blocks become plain free blocks, their prefixes forgotten (a
        replaced stage holds garbage in them); blocks in use stay cached and shareable."""
        self._gpu.drop_evictor()

    def gpu_high_water(self) -> int:
        """One past the highest device block handed out since the last reset: every block in
        use (or parked with cached KV) is below it."""
        return self._gpu.high_water

    def get_num_cached_free_blocks(self) -> int:
        """Unreferenced blocks that still hold cached KV (counted as free)."""
        return len(self._gpu.evictor)

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
        # Cached blocks already in use cost nothing; parked ones count as free already.
        _, hits = self._cached_prefix(seq_group)
        required -= sum(1 for block in hits if self._gpu.ref_count(block) > 0)
        if self._gpu.num_free() - required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group: SequenceGroup) -> int:
        """Give the group's WAITING sequences blocks for their tokens, one shared set per
        distinct token list.

        Returns how many leading tokens found their KV in the prefix cache (0 without prefix
        caching, or for sequences that diverged before a recompute): the caller records them
        as computed."""
        prompt_sets = self._prompt_sets(seq_group)
        if not prompt_sets:
            return 0
        num_blocks = self._blocks_to_allocate(seq_group)
        hashes, hits = self._cached_prefix(seq_group)
        parked = sum(1 for block in hits if self._gpu.ref_count(block) == 0)
        if num_blocks - len(hits) + parked > self._gpu.num_free():
            # Checked up front so a failed allocation leaks no blocks.
            raise ValueError(
                f"Out of memory! Need {num_blocks} gpu blocks, {self._gpu.num_free()} free."
            )
        if hashes and _reads_prefix_cache(seq_group):
            self.num_queried_blocks += (prompt_sets[0][0].get_len() - 1) // self.block_size
            self.num_hit_blocks += len(hits)
        for seqs in prompt_sets:
            table: list[int] = []
            # `hashes` and `hits` are empty unless there is a single token list.
            for block in hits:
                self._gpu.revive(block)
                table.append(block)
            for index in range(len(hits), self._blocks_for(seqs[0].get_len())):
                block = self._gpu.allocate()
                # A prefix being computed elsewhere right now keeps its first block; this copy
                # stays private.
                if index < len(hashes) and hashes[index] not in self._hash_to_block:
                    self._hash_to_block[hashes[index]] = block
                    self._block_to_hash[block] = hashes[index]
                table.append(block)
            for block in table:
                for _ in seqs[1:]:
                    self._gpu.incref(block)
            for seq in seqs:
                self._gpu_tables[seq.seq_id] = list(table)
                self._table_epochs[seq.seq_id] = next(self._epochs)
        return len(hits) * self.block_size

    # -- decode growth ---------------------------------------------------------------------

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Conservative: every RUNNING sequence may need a fresh block for its next token."""
        return self._gpu.num_free() >= seq_group.num_seqs(status=SequenceStatus.RUNNING)

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0) -> list[tuple[int, int]]:
        """Make room for the tokens at positions `seq.get_len() - 1` through
        `seq.get_len() - 1 + num_lookahead_slots` (a lookahead slot is for a token sampled by
        a step still in flight, or a draft token a speculative step verifies).

        Returns the copy-on-write pairs (src, dst) the workers must copy before writing.
        A table may already reach past the sequence's end (blocks a speculative step took for
        drafts that were rejected): their KV is garbage and is simply written over.
        """
        table = self._gpu_tables[seq.seq_id]
        first = (seq.get_len() - 1) // self.block_size  # the block of the first write
        needed = self._blocks_for(seq.get_len() + num_lookahead_slots)
        pairs: list[tuple[int, int]] = []
        # Blocks written that are shared with a forked sibling: write into private copies.
        for index in range(first, min(len(table), needed)):
            block = table[index]
            if self._gpu.ref_count(block) == 1:
                continue
            new_block = self._gpu.allocate()
            table[index] = new_block
            self._table_epochs[seq.seq_id] = next(self._epochs)
            self._gpu.free(block)
            pairs.append((block, new_block))
        # New blocks start empty, so nothing shared is written there.
        while len(table) < needed:
            table.append(self._gpu.allocate())
        return pairs

    def lookahead_cost(self, seq: Sequence, num_lookahead_slots: int) -> int:
        """Free blocks `append_slots(seq, num_lookahead_slots)` would take (new blocks and
        private copies of shared ones)."""
        table = self._gpu_tables[seq.seq_id]
        first = (seq.get_len() - 1) // self.block_size
        needed = self._blocks_for(seq.get_len() + num_lookahead_slots)
        shared = sum(
            1 for index in range(first, min(len(table), needed))
            if self._gpu.ref_count(table[index]) > 1
        )  # fmt: skip
        return shared + max(0, needed - len(table))

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares all of the parent's blocks until one of them writes."""
        table = self._gpu_tables[parent_seq.seq_id]
        for block in table:
            self._gpu.incref(block)
        self._gpu_tables[child_seq.seq_id] = list(table)
        self._table_epochs[child_seq.seq_id] = next(self._epochs)

    # -- swapping --------------------------------------------------------------------------

    def _unique_blocks(self, seqs: list[Sequence], tables: dict[int, list[int]]) -> set[int]:
        blocks: set[int] = set()
        for seq in seqs:
            blocks.update(tables.get(seq.seq_id, ()))
        return blocks

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        """Room for the group's swapped blocks plus one new block per sequence (next token):
        now (OK), once others free blocks (LATER), or never, even with the cache empty."""
        seqs = seq_group.get_seqs(status=SequenceStatus.SWAPPED)
        required = len(self._unique_blocks(seqs, self._cpu_tables)) + len(seqs)
        if self.num_total_gpu_blocks - required < self.watermark_blocks:
            return AllocStatus.NEVER
        if self._gpu.num_free() - required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def num_swapped_blocks(self, seq_group: SequenceGroup) -> int:
        """Host blocks the group's SWAPPED sequences hold (a shared one once)."""
        seqs = seq_group.get_seqs(status=SequenceStatus.SWAPPED)
        return len(self._unique_blocks(seqs, self._cpu_tables))

    def exclusive_blocks(self, seq_group: SequenceGroup) -> int | None:
        """The device blocks of the group's RUNNING sequences when no other sequence holds
        any of them (swapping the group out frees exactly these, and swapping it back in
        needs no more); None when one is shared with another group (a cached prefix)."""
        held: dict[int, int] = {}
        for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
            for block in self._gpu_tables.get(seq.seq_id, []):
                held[block] = held.get(block, 0) + 1
        if any(self._gpu.ref_count(block) != n for block, n in held.items()):
            return None
        return len(held)

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
            self._table_epochs[seq.seq_id] = next(self._epochs)
        return mapping

    # -- release and queries ---------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references to its blocks (no-op if it holds none)."""
        for tables, allocator in ((self._gpu_tables, self._gpu), (self._cpu_tables, self._cpu)):
            self._table_epochs.pop(seq.seq_id, None)
            table = tables.pop(seq.seq_id, None)
            if table is not None:
                # Last block first: the LRU evictor then reuses the deepest blocks of a
                # prefix before the ones it starts with.
                for block in reversed(table):
                    allocator.free(block)

    def get_block_table(self, seq: Sequence) -> list[int]:
        """Physical block numbers of the sequence, in token order (on its current device)."""
        table = self._gpu_tables.get(seq.seq_id)
        if table is None:
            table = self._cpu_tables[seq.seq_id]
        return list(table)

    def table_epoch(self, seq: Sequence) -> int:
        """The epoch of the sequence's table: the same number as long as the table only grew
        by appending since (0: it has no table)."""
        return self._table_epochs.get(seq.seq_id, 0)

    def get_num_free_gpu_blocks(self) -> int:
        """Free device (GPU, or the CPU KV cache on CPU runs) blocks."""
        return self._gpu.num_free()

    def get_num_free_cpu_blocks(self) -> int:
        """Free swap-space blocks."""
        return self._cpu.num_free()


def _reads_prefix_cache(seq_group: SequenceGroup) -> bool:
    """Whether the group may skip a cached prefix: not when every prompt position's output is
    wanted (prompt logprobs; pooling over every token)."""
    if getattr(seq_group.sampling_params, "prompt_logprobs", None) is not None:
        return False
    pooling = getattr(seq_group, "pooling_params", None)
    return pooling is None or not pooling.skip_reading_prefix_cache
