"""Paged attention in torch: write K/V through the slot mapping, attend over the prompt for
prefills, and over the paged cache through block tables for decodes."""

from __future__ import annotations

from typing import Optional

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


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: KVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its cached context.

    query [B, H, D]; block_tables [B, max_blocks]; context_lens [B]. Returns [B, H, D].
    CPU float32/bfloat16 runs the C++ kernel when it is built (vllm/_custom_ops.py), which reads
    K/V through the block tables in place; otherwise this torch code gathers them.
    """
    from vllm import _custom_ops as ops  # cheap after the first call (a sys.modules lookup)

    key_cache, value_cache = kv_cache
    if ops.supports_attention(query, key_cache):
        return ops.paged_attention_decode(
            query, key_cache, value_cache, block_tables, context_lens, scale
        )
    batch, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks_needed = (max_context_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks_needed]
    # Gather the context: [B, n_blocks, block_size, Hkv, D] -> [B, L, Hkv, D].
    keys = key_cache[tables].view(batch, -1, num_kv_heads, head_size)
    values = value_cache[tables].view(batch, -1, num_kv_heads, head_size)
    ctx = keys.shape[1]
    # [B, L]: slots past a sequence's length hold stale or uninitialised memory.
    valid = torch.arange(ctx, device=query.device)[None, :] < context_lens[:, None]
    # GQA without repeating K/V: query heads grouped by the KV head they share.
    q = query.view(batch, num_kv_heads, group, head_size)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)) * scale  # [B, Hkv, G, L]
    scores = scores.float().masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    # Uninitialised cache memory may hold NaN/inf, and 0 * NaN is NaN: zero it out.
    values = torch.where(valid[:, :, None, None], values, values.new_zeros(()))
    out = torch.matmul(probs, values.transpose(1, 2))  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_size)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each prompt over itself. query [T, H, D], key/value [T, Hkv, D]."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    out = torch.empty_like(query)
    start = 0
    for length in seq_lens:
        end = start + length
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
) -> torch.Tensor:
    """Causal attention of one prefill chunk over its cached context plus itself.

    query [L, H, D] holds positions context_len .. context_len + L - 1; their K/V are already
    written to the cache, so the keys and values of all context_len + L positions are read
    back through `block_table` ([>= n_blocks] int64). Query i sees keys 0 .. context_len + i
    (causal, aligned to the end). Returns [L, H, D]."""
    key_cache, value_cache = kv_cache
    length, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    total = context_len + length
    table = block_table[: (total + block_size - 1) // block_size]
    # [n_blocks, block_size, Hkv, D] -> [total, Hkv, D]: only written slots are kept.
    keys = key_cache.index_select(0, table).view(-1, num_kv_heads, head_size)[:total]
    values = value_cache.index_select(0, table).view(-1, num_kv_heads, head_size)[:total]
    rows = torch.arange(length, device=query.device)[:, None] + context_len
    mask = torch.arange(total, device=query.device)[None, :] <= rows  # [L, total]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out[0].transpose(0, 1)


class PagedAttention(nn.Module):
    """Multi-head / grouped-query attention over a paged KV cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})."
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: Optional[KVCache],
        md: InputMetadata,
    ) -> torch.Tensor:
        """query [T, H*D], key/value [T, Hkv*D] -> [T, H*D]."""
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        if kv_cache is not None and num_tokens > 0:
            write_to_kv_cache(k, v, kv_cache, md.slot_mapping)
        out = torch.empty_like(q)
        n_pre = md.num_prefill_tokens
        if md.num_prefills > 0:
            contexts = md.prefill_context_list
            if not any(contexts):
                out[:n_pre] = prefill_attention(
                    q[:n_pre], k[:n_pre], v[:n_pre], md.prefill_lens, self.scale
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
                    q[start:end], k[start:end], v[start:end], [length], self.scale
                )
            else:
                assert md.prefill_block_tables is not None
                out[start:end] = prefill_attention_with_context(
                    q[start:end], kv_cache, md.prefill_block_tables[index], context, self.scale
                )
            start = end
