"""Paged attention in torch: write K/V through the slot mapping, attend over the prompt for
prefills, and over the paged cache through block tables for decodes; optionally within a
sliding window and with soft-capped scores."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.input_metadata import InputMetadata

# (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_size].
KVCache = tuple[torch.Tensor, torch.Tensor]


def write_to_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V ([T, Hkv, D]) at its flat slot of this layer's paged cache.

    Uses the C++ kernel for CPU tensors when it is built (vllm/_custom_ops.py), else index_copy_.
    """
    from vllm import _custom_ops as ops  # cheap after the first call (a sys.modules lookup)

    key_cache, value_cache = kv_cache
    if ops.supports_cache_write(key, key_cache):
        ops.write_to_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value)


def _check_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """ValueError naming the option when a window or a soft-cap is not positive."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}.")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(
            f"logits_soft_cap must be a positive float or None, got {logits_soft_cap!r}."
        )


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) (Gemma 2's attention and final logit capping), in HF's order of
    operations; the scores unchanged when cap is None."""
    if cap is None:
        return scores
    return torch.tanh(scores / cap) * cap


def first_visible_position(context_len: int, sliding_window: int | None) -> int:
    """The first key position a query at position `context_len - 1` sees: HF's sliding mask
    keeps key j for query i when i - W < j <= i, i.e. the last W positions, the query's own
    included (transformers' `sliding_window_overlay`; Mistral and Gemma alike)."""
    if sliding_window is None:
        return 0
    return max(0, context_len - sliding_window)


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: KVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence against its cached context.

    query [B, H, D]; block_tables [B, max_blocks]; context_lens [B]. Returns [B, H, D].
    With `sliding_window` W the query (at position context_len - 1) sees only the last W
    positions, and blocks wholly before them are not read. With `logits_soft_cap` c the scores
    become c * tanh(scores / c) before the softmax.
    CPU float32/bfloat16 runs the C++ kernel when it is built (vllm/_custom_ops.py), which reads
    K/V through the block tables in place; otherwise this torch code gathers them.
    """
    from vllm import _custom_ops as ops  # cheap after the first call (a sys.modules lookup)

    key_cache, value_cache = kv_cache
    if ops.supports_attention(query, key_cache):
        return ops.paged_attention_decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale,
            sliding_window,
            logits_soft_cap,
        )
    batch, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    device = query.device
    if sliding_window is None:
        num_blocks_needed = (max_context_len + block_size - 1) // block_size
        tables = block_tables[:, :num_blocks_needed]
        first_pos = torch.zeros_like(context_lens)
        base = torch.zeros_like(context_lens)
    else:
        # Only the blocks that hold the window: from the one of the first visible position.
        first_pos = (context_lens - sliding_window).clamp(min=0)  # [B]
        first_block = first_pos // block_size
        span = (context_lens - first_block * block_size).max().item() if batch else 0
        num_blocks_needed = (int(span) + block_size - 1) // block_size
        cols = first_block[:, None] + torch.arange(num_blocks_needed, device=device)
        # Columns past a table's end belong to no sequence: clamped here, masked below.
        cols = cols.clamp(max=max(block_tables.shape[1] - 1, 0))
        tables = torch.gather(block_tables, 1, cols) if num_blocks_needed else cols
        base = first_block * block_size  # [B]: position of each gathered context's slot 0
    # Gather the context: [B, n_blocks, block_size, Hkv, D] -> [B, L, Hkv, D].
    keys = key_cache[tables].view(batch, -1, num_kv_heads, head_size)
    values = value_cache[tables].view(batch, -1, num_kv_heads, head_size)
    ctx = keys.shape[1]
    positions = base[:, None] + torch.arange(ctx, device=device)[None, :]  # [B, L]
    # [B, L]: slots past a sequence's length hold stale or uninitialised memory; slots before
    # the window are out of sight.
    valid = (positions < context_lens[:, None]) & (positions >= first_pos[:, None])
    # GQA without repeating K/V: query heads grouped by the KV head they share.
    q = query.view(batch, num_kv_heads, group, head_size)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)) * scale  # [B, Hkv, G, L]
    scores = soft_cap(scores, logits_soft_cap)
    scores = scores.float().masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    # Uninitialised cache memory may hold NaN/inf, and 0 * NaN is NaN: zero it out.
    values = torch.where(valid[:, :, None, None], values, values.new_zeros(()))
    out = torch.matmul(probs, values.transpose(1, 2))  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_size)


# Query rows per piece of a masked attention: bounds its [H, rows, keys] score matrix.
_QUERY_CHUNK = 512


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start: int,
    key_start: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal (and, with a window, banded) attention with explicit positions.

    query [Lq, H, D] at positions query_start .. query_start + Lq - 1; key/value [Lk, Hkv, D] at
    positions key_start .. key_start + Lk - 1, covering every key a query may see. A query at
    position i sees key j when j <= i and, with a window W, j > i - W. Without a soft-cap this
    is SDPA with a boolean mask; with one, HF's eager order: scores * scale, soft-cap, mask,
    float32 softmax, cast, times V. Queries go in pieces of _QUERY_CHUNK rows, each against
    only the keys its rows can see. Returns [Lq, H, D].
    """
    num_q, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    device = query.device
    for lo in range(0, num_q, _QUERY_CHUNK):
        hi = min(num_q, lo + _QUERY_CHUNK)
        q_pos = torch.arange(query_start + lo, query_start + hi, device=device)  # [c]
        # Keys this piece can see: up to its last query, from its first query's window start.
        k_lo = first_visible_position(query_start + lo + 1, sliding_window) - key_start
        k_lo = max(k_lo, 0)
        k_hi = query_start + hi - key_start
        k_pos = torch.arange(key_start + k_lo, key_start + k_hi, device=device)  # [n]
        mask = k_pos[None, :] <= q_pos[:, None]  # [c, n]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        q = query[lo:hi].transpose(0, 1)  # [H, c, D]
        k = key[k_lo:k_hi].transpose(0, 1)  # [Hkv, n, D]
        v = value[k_lo:k_hi].transpose(0, 1)
        if logits_soft_cap is None:
            o = F.scaled_dot_product_attention(
                q.unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                attn_mask=mask,
                scale=scale,
                enable_gqa=group != 1,
            )[0]  # [H, c, D]
        else:
            qg = q.reshape(num_kv_heads, group, hi - lo, head_size)
            scores = torch.matmul(qg, k.transpose(1, 2)[:, None]) * scale  # [Hkv, G, c, n]
            scores = soft_cap(scores, logits_soft_cap)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            o = torch.matmul(probs, v[:, None]).reshape(num_heads, hi - lo, head_size)
        out[lo:hi] = o.transpose(0, 1)
    return out


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each prompt over itself. query [T, H, D], key/value [T, Hkv, D].

    A prompt no longer than the window, without a soft-cap, takes SDPA's causal path; the
    others go through `masked_attention`."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    out = torch.empty_like(query)
    start = 0
    for length in seq_lens:
        end = start + length
        if logits_soft_cap is not None or (sliding_window is not None and length > sliding_window):
            out[start:end] = masked_attention(
                query[start:end],
                key[start:end],
                value[start:end],
                0,
                0,
                scale,
                sliding_window,
                logits_soft_cap,
            )
            start = end
            continue
        # SDPA wants [1, H, L, D]: only 4-D inputs take torch's CPU flash kernel (~2x faster
        # than the math path, which 3-D inputs fall back to, and no [L, L] score matrix).
        # enable_gqa lets KV heads serve their query-head groups.
        o = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1).unsqueeze(0),
            key[start:end].transpose(0, 1).unsqueeze(0),
            value[start:end].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out


def prefill_attention_with_context(
    query: torch.Tensor,
    kv_cache: KVCache,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one prefill chunk over its cached context plus itself.

    query [L, H, D] holds positions context_len .. context_len + L - 1; their K/V are already
    written to the cache, so the keys and values are read back through `block_table`
    ([>= n_blocks] int64). Query i sees keys 0 .. context_len + i (causal, aligned to the end),
    only the last `sliding_window` of them with a window: then the blocks wholly before the
    first query's window are not read. Returns [L, H, D]."""
    from vllm import _custom_ops as ops  # cheap after the first call (a sys.modules lookup)

    key_cache, value_cache = kv_cache
    if ops.supports_prefill_attention(query, key_cache, sliding_window, logits_soft_cap):
        # The C++ kernel reads K/V from the cache blocks and skips the masked pairs (1.2-1.9x
        # SDPA's masked path on SmolLM2's shapes, one AVX2 core).
        return ops.prefill_attention_paged(
            query, key_cache, value_cache, block_table, context_len, scale
        )
    length = query.shape[0]
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    total = context_len + length
    first_block = first_visible_position(context_len + 1, sliding_window) // block_size
    table = block_table[first_block : (total + block_size - 1) // block_size]
    key_start = first_block * block_size
    # [n_blocks, block_size, Hkv, D] -> [total - key_start, Hkv, D]: only written slots kept.
    keys = key_cache.index_select(0, table).view(-1, num_kv_heads, head_size)
    values = value_cache.index_select(0, table).view(-1, num_kv_heads, head_size)
    keys, values = keys[: total - key_start], values[: total - key_start]
    return masked_attention(
        query, keys, values, context_len, key_start, scale, sliding_window, logits_soft_cap
    )


class PagedAttention(nn.Module):
    """Multi-head / grouped-query attention over a paged KV cache.

    `scale` multiplies the scores (head_size ** -0.5 for most models; Gemma's
    query_pre_attn_scalar ** -0.5). With `sliding_window` W a query sees only the last W
    positions, its own included (local layers of Mistral, Gemma 2/3); the blocks before them
    stay allocated but are not read. With `logits_soft_cap` c the scores become
    c * tanh(scores / c) before the softmax (Gemma 2). Both hold in every path: prefill,
    prefill over a cached context (chunked prefill, prefix caching) and decode.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})."
            )
        _check_options(sliding_window, logits_soft_cap)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap is not None else None

    @property
    def _options(self) -> tuple[int | None, float | None]:
        """(sliding_window, logits_soft_cap), as the attention functions take them."""
        return self.sliding_window, self.logits_soft_cap

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"scale={self.scale}, sliding_window={self.sliding_window}, "
            f"logits_soft_cap={self.logits_soft_cap}"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache | None,
        md: InputMetadata,
    ) -> torch.Tensor:
        """query [T, H*D], key/value [T, Hkv*D] -> [T, H*D]."""
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        if kv_cache is not None and num_tokens > 0:
            write_to_kv_cache(k, v, kv_cache, md.slot_mapping)
        if md.num_prefills == 0 and md.num_decode_tokens == num_tokens > 0:
            # Decodes only (every step of a batch-1 decode): the result is the output, no
            # buffer to fill and copy into.
            assert kv_cache is not None, "decoding needs a KV cache"
            decoded = paged_decode_attention(
                q,
                kv_cache,
                md.decode_block_tables,
                md.decode_context_lens,
                md.decode_max_len,
                self.scale,
                *self._options,
            )  # [T, H, D]
            return decoded.reshape(num_tokens, self.num_heads * self.head_size)
        out = torch.empty_like(q)
        n_pre = md.num_prefill_tokens
        if md.num_prefills > 0:
            contexts = md.prefill_context_list
            if not any(contexts):
                out[:n_pre] = prefill_attention(
                    q[:n_pre], k[:n_pre], v[:n_pre], md.prefill_lens, self.scale, *self._options
                )
            else:
                assert kv_cache is not None, "a prefill with cached context needs the cache"
                self._prefill_with_contexts(q, k, v, kv_cache, md, out)
        if md.num_decode_tokens > 0:
            assert kv_cache is not None, "decoding needs a KV cache"
            out[n_pre:] = paged_decode_attention(
                q[n_pre:],
                kv_cache,
                md.decode_block_tables,
                md.decode_context_lens,
                md.decode_max_len,
                self.scale,
                *self._options,
            )
        return out.view(num_tokens, self.num_heads * self.head_size)

    def _prefill_with_contexts(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        md: InputMetadata,
        out: torch.Tensor,
    ) -> None:
        """Prefills of a batch where some continue after cached tokens (chunks, prefix hits):
        those attend over the cache, the others take the plain path."""
        start = 0
        for index, (length, context) in enumerate(zip(md.prefill_lens, md.prefill_context_list)):
            end = start + length
            if context == 0:
                out[start:end] = prefill_attention(
                    q[start:end], k[start:end], v[start:end], [length], self.scale, *self._options
                )
            else:
                assert md.prefill_block_tables is not None
                out[start:end] = prefill_attention_with_context(
                    q[start:end],
                    kv_cache,
                    md.prefill_block_tables[index],
                    context,
                    self.scale,
                    *self._options,
                )
            start = end
