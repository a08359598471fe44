"""A draft model's side of speculation: persistent draft sequences in a paged KV cache of the
draft's own, and k greedy draft forwards per proposal in one call.

Each target sequence has a draft sequence (keyed by request id and sequence id) whose KV
stays in the draft's cache from one proposal to the next. A proposal brings the target
sequence's tokens; the draft keeps the longest prefix it already holds (what the target
accepted) and forgets the rest -- its rejected drafts are simply overwritten, the blocks
stay with the sequence -- then feeds the new tokens in one forward (a prefill chunk after its
cached context) and decodes k-1 more, taking the argmax each time. A proposal thus costs k
forwards of the draft and nothing else: no scheduler, no re-prefill, no output processing.

The cache is the draft worker's (`Worker.initialize_cache`, sized from `kv_cache_space`
like a stage's); its blocks are handed out here, one free list. Sequences of finished
requests give theirs back (`propose(..., finished=...)`); when blocks run out the sequences
not used for the longest time are evicted (a later proposal for one re-prefills it).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.model_executor.input_metadata import InputMetadata

# New tokens per sequence up to which a proposal's first forward runs them as decode rows
# (`DraftRunner._decode_rows`); longer ones (a new prompt) as a prefill chunk, whose kernels
# are made for many rows. Measured with the SmolLM2 Q4_1 draft: see docs/PERFORMANCE.md.
_MAX_DECODE_ROWS = 8
# A proposal asked of the runner: (request id, sequence id, the target's token ids, k).
DraftRequest = tuple[str, int, list[int], int]


@dataclass
class _DraftSeq:
    """What the draft's cache holds of one target sequence."""

    tokens: list[int] = field(default_factory=list)  # ids whose KV is written, in order
    blocks: list[int] = field(default_factory=list)  # its block table


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of `a` and `b` (slice compares run in C; a
    prefix being equal is monotone in its length, so a binary search finds the longest)."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo] holds; a[:hi] == b[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class DraftRunner:
    """Greedy proposals of a draft model over persistent draft sequences (module docstring).

    `model` is the whole draft model (every layer, embeddings and lm_head), `kv_caches` its
    per-layer (key, value) caches of `num_blocks` blocks of `block_size` tokens;
    `reserve(n)` maps blocks below n before they are written (`CacheEngine.reserve`)."""

    def __init__(
        self,
        model: Any,
        kv_caches: list[Any],
        num_blocks: int,
        block_size: int,
        device: torch.device,
        reserve: Any = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self._reserve = reserve
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low blocks first
        self._reserved = 0  # blocks below this are mapped
        self._top = 0  # blocks below this were handed out at some point
        # (request id, seq id) -> its draft sequence, least recently used first.
        self._seqs: collections.OrderedDict[tuple[str, int], _DraftSeq] = collections.OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    def release(self, request_ids: list[str]) -> None:
        """Finished (or aborted) requests: their draft sequences' blocks are free again."""
        if not request_ids or not self._seqs:
            return
        gone = set(request_ids)
        for key in [key for key in self._seqs if key[0] in gone]:
            self._free.extend(self._seqs.pop(key).blocks)

    @torch.inference_mode()
    def propose(
        self, requests: list[DraftRequest], finished: list[str] | None = None
    ) -> list[list[int]]:
        """The k greedy draft tokens after each request's token ids ([] when the cache cannot
        hold the sequence), after releasing the `finished` requests' sequences."""
        self.release(finished or [])
        results: list[list[int]] = [[] for _ in requests]
        live: list[tuple[int, _DraftSeq, int, int]] = []  # (index, seq, kept, k)
        keys = {(rid, sid) for rid, sid, _, _ in requests}
        for index, (request_id, seq_id, token_ids, k) in enumerate(requests):
            if k < 1 or not token_ids:
                continue
            key = (request_id, seq_id)
            seq = self._seqs.pop(key, None) or _DraftSeq()
            self._seqs[key] = seq  # most recently used
            # At least the last token is fed: its logits give the first draft.
            kept = min(_common_prefix(seq.tokens, token_ids), len(token_ids) - 1)
            del seq.tokens[kept:]
            seq.tokens.extend(token_ids[kept:])
            # The KV written by this proposal: the tokens, then k - 1 drafts fed back.
            if not self._grow(seq, len(token_ids) + k - 1, keys):
                self._free.extend(self._seqs.pop(key).blocks)
                continue
            live.append((index, seq, kept, k))
        if not live:
            return results
        self._map_blocks()
        # Forward 1: each sequence's new tokens as a prefill chunk after its cached context.
        last = self._feed_new_tokens([(seq, kept) for _, seq, kept, _ in live])  # [S]
        for (index, _, _, _), token in zip(live, last):
            results[index].append(token)
        # Forwards 2..k: one decode per sequence still drafting, fed its previous draft.
        for step in range(1, max(k for *_, k in live)):
            going = [(index, seq) for index, seq, _, k in live if k > step]
            fed = [results[index][-1] for index, _ in going]
            for token, (_, seq) in zip(fed, going):
                seq.tokens.append(token)
            nxt = self._decode([seq for _, seq in going], fed)
            for token, (index, _) in zip(nxt, going):
                results[index].append(token)
        return results

    def _grow(self, seq: _DraftSeq, length: int, keep: set[tuple[str, int]]) -> bool:
        """Give `seq` the blocks for `length` tokens, evicting the least recently used
        sequences not in `keep` when the free list runs out; False when it cannot."""
        needed = -(-length // self.block_size) - len(seq.blocks)
        while needed > len(self._free):
            victim = next((key for key in self._seqs if key not in keep), None)
            if victim is None:
                return False
            self._free.extend(self._seqs.pop(victim).blocks)
        for _ in range(max(needed, 0)):
            block = self._free.pop()
            seq.blocks.append(block)
            self._top = max(self._top, block + 1)
        return True

    def _map_blocks(self) -> None:
        """Map the blocks handed out so far before the forward writes them."""
        if self._reserve is not None and self._top > self._reserved:
            self._reserve(self._top)
            self._reserved = self._top

    def _slots(self, seq: _DraftSeq, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.blocks
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _feed_new_tokens(self, chunks: list[tuple[_DraftSeq, int]]) -> list[int]:
        """One forward of every sequence's tokens from `kept` on (its KV before `kept` is in
        the cache); the argmax after each sequence's last token. A few new tokens each (the
        usual case: the last draft and the target's token) go as decode rows."""
        if all(len(seq.tokens) - kept <= _MAX_DECODE_ROWS for seq, kept in chunks):
            rows = [(seq, p, seq.tokens[p]) for seq, kept in chunks
                    for p in range(kept, len(seq.tokens))]  # fmt: skip
            ends = list(itertools.accumulate(len(seq.tokens) - kept for seq, kept in chunks))
            return self._argmax(self._decode_rows(rows), [end - 1 for end in ends])
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        contexts: list[int] = []
        for seq, kept in chunks:
            end = len(seq.tokens)
            input_ids.extend(seq.tokens[kept:])
            positions.extend(range(kept, end))
            slots.extend(self._slots(seq, kept, end))
            lens.append(end - kept)
            contexts.append(kept)
        if any(contexts):
            width = max(len(seq.blocks) for seq, _ in chunks)
            tables = [seq.blocks + [0] * (width - len(seq.blocks)) for seq, _ in chunks]
            block_tables = self._long([b for t in tables for b in t]).view(len(chunks), width)
        else:  # plain prompts: attention reads no cache
            block_tables = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        seq_lens = torch.tensor(lens, dtype=torch.long)
        context_lens = torch.tensor(contexts, dtype=torch.long)
        md = InputMetadata(
            num_prefills=len(chunks),
            num_prefill_tokens=len(input_ids),
            num_decode_tokens=0,
            slot_mapping=self._long(slots),
            prefill_seq_lens=seq_lens,
            decode_context_lens=empty,
            decode_block_tables=empty.view(0, 0),
            prefill_context_lens=context_lens,
            prefill_block_tables=block_tables,
            prefill_total_lens=seq_lens + context_lens,
        )
        md._prefill_lens_list = lens
        md._prefill_context_list = contexts
        md._decode_max_len = 0
        hidden = self.model(self._long(input_ids), self._long(positions), self.kv_caches, md)
        return self._argmax(hidden, [end - 1 for end in itertools.accumulate(lens)])

    def _decode_rows(self, rows: list[tuple[_DraftSeq, int, int]]) -> torch.Tensor:
        """One forward of decode rows (sequence, position, token), a sequence's rows in
        position order; returns the hidden states [R, H]. Rows of one sequence may follow
        each other: every layer writes all rows' KV before it attends, and a row attends
        only up to its own position, so this is the causal forward of a chunk -- on the
        decode fast path (`llama_decode`), which a chunk never takes."""
        width = max(len(seq.blocks) for seq, _, _ in rows)
        tables = [b for seq, _, _ in rows for b in seq.blocks + [0] * (width - len(seq.blocks))]
        slots = [self._slots(seq, p, p + 1)[0] for seq, p, _ in rows]
        empty = torch.empty(0, dtype=torch.long)
        md = InputMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=len(rows),
            slot_mapping=self._long(slots),
            prefill_seq_lens=empty,
            decode_context_lens=self._long([p + 1 for _, p, _ in rows]),
            decode_block_tables=self._long(tables).view(len(rows), width),
        )
        md._prefill_lens_list = []
        md._prefill_context_list = []
        md._decode_max_len = max(p for _, p, _ in rows) + 1
        ids = self._long([token for _, _, token in rows])
        positions = self._long([p for _, p, _ in rows])
        return self.model(ids, positions, self.kv_caches, md)

    def _decode(self, seqs: list[_DraftSeq], fed: list[int]) -> list[int]:
        """One decode forward: each sequence's last token (`fed`, already appended to its
        tokens) at its last position; the argmax of each."""
        rows = [(seq, len(seq.tokens) - 1, token) for seq, token in zip(seqs, fed)]
        return self._argmax(self._decode_rows(rows), list(range(len(seqs))))

    def _argmax(self, hidden: torch.Tensor, rows: list[int]) -> list[int]:
        """The greedy token after each of `rows` of `hidden` [T, H]."""
        picked = hidden.index_select(0, self._long(rows))  # [S, H]
        logits = self.model.compute_logits(picked)  # [S, V]
        return logits.argmax(dim=-1).tolist()
