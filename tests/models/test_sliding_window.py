"""Sliding-window and soft-capped attention in every path, against a plain masked reference.

The reference (float64) attends query position i to key positions j with j <= i and, with a
window W, j > i - W (HF's mask: the last W positions, the query's own included), soft-capping
the scaled scores as c * tanh(s / c) first. Paths: prefill (SDPA and the masked path, across
the query-chunk boundary), prefill over a cached context (chunked prefill / prefix caching),
decode in torch and in the C++ kernel (every ISA, float32 and bfloat16), and the PagedAttention
layer running a prompt in chunks then decoding, against the same prompt in one piece.

Paged caches are filled with NaN everywhere except the positions an attention may read: a read
of a slot outside a window (or past a context) brings NaN into the output, so these tests also
show that blocks wholly outside the window are not read.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.utils.kernel_env import set_kernels
from vllm import _custom_ops as ops
from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.layers import attention as attn_mod
from vllm.model_executor.layers.attention import (
    PagedAttention,
    paged_decode_attention,
    prefill_attention,
    prefill_attention_with_context,
)

F32_TOL = dict(rtol=1e-4, atol=1e-5)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
OPTIONS = [(None, None), (5, None), (16, None), (None, 1.5), (5, 1.5), (12, 30.0)]
HEADS, KV_HEADS, HEAD = 4, 2, 16


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    window: int | None,
    cap: float | None,
) -> torch.Tensor:
    """q [n, H, D] at q_positions [n]; k/v [total, Hkv, D] at positions 0 .. total - 1."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q, k) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    pos = torch.arange(k.shape[0])
    mask = pos[None, :] <= q_positions[:, None]
    if window is not None:
        mask &= pos[None, :] > q_positions[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), v)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("window,cap", OPTIONS)
def test_prefill_matches_reference(window, cap, monkeypatch):
    """Several prompts back to back, shorter and longer than the window; the long one crosses
    the masked path's query-chunk boundary (made small here)."""
    monkeypatch.setattr(attn_mod, "_QUERY_CHUNK", 16)
    gen = torch.Generator().manual_seed(0)
    lens = [3, 20, 7, 41]
    total = sum(lens)
    q = randn(total, HEADS, HEAD, gen=gen)
    k, v = randn(total, KV_HEADS, HEAD, gen=gen), randn(total, KV_HEADS, HEAD, gen=gen)
    out = prefill_attention(q, k, v, lens, 0.3, window, cap)
    start = 0
    for n in lens:
        s = slice(start, start + n)
        ref = reference(q[s], k[s], v[s], torch.arange(n), 0.3, window, cap)
        torch.testing.assert_close(out[s].double(), ref, **F32_TOL)
        start += n


def make_paged(
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    first_readable: int,
    gen: torch.Generator,
    extra_blocks: int = 3,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A NaN-filled paged cache holding positions first_readable .. len(k) - 1 of one
    sequence in shuffled blocks; returns (cache, block table [n_blocks + 2])."""
    n_blocks = math.ceil(k.shape[0] / block_size)
    num_blocks = n_blocks + extra_blocks
    shape = (num_blocks, block_size, k.shape[1], k.shape[2])
    key_cache = torch.full(shape, float("nan"), dtype=k.dtype)
    value_cache = torch.full(shape, float("nan"), dtype=k.dtype)
    table = torch.randperm(num_blocks, generator=gen)[: n_blocks + 2]  # 2 stale columns
    pos = torch.arange(first_readable, k.shape[0])
    blocks, offsets = table[pos // block_size], pos % block_size
    key_cache[blocks, offsets] = k[pos]
    value_cache[blocks, offsets] = v[pos]
    return (key_cache, value_cache), table


@pytest.mark.parametrize("window,cap", OPTIONS)
@pytest.mark.parametrize("context,length", [(3, 5), (8, 8), (29, 11), (40, 1), (17, 30)])
def test_prefill_with_context_matches_reference(window, cap, context, length, monkeypatch):
    """A chunk at positions context .. context + length - 1 over its cached context, block size
    8; positions before the first query's window are NaN (must not be read)."""
    monkeypatch.setattr(attn_mod, "_QUERY_CHUNK", 16)
    gen = torch.Generator().manual_seed(context * 100 + length)
    total = context + length
    q = randn(length, HEADS, HEAD, gen=gen)
    k, v = randn(total, KV_HEADS, HEAD, gen=gen), randn(total, KV_HEADS, HEAD, gen=gen)
    first = max(0, context + 1 - window) if window else 0
    cache, table = make_paged(k, v, 8, first, gen)
    out = prefill_attention_with_context(q, cache, table, context, 0.3, window, cap)
    ref = reference(q, k, v, torch.arange(context, total), 0.3, window, cap)
    torch.testing.assert_close(out.double(), ref, **F32_TOL)


def decode_case(
    lens: list[int],
    window: int | None,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    head: int = HEAD,
) -> tuple:
    """A batch of decoding sequences in one NaN-filled cache: each sequence's K/V only at the
    positions its query sees (the last `window`). Returns (query, cache, tables, lens, refs)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(per_seq) + 4
    shape = (num_blocks, block_size, KV_HEADS, head)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    # Stale columns past each table's end point anywhere, NaN blocks included.
    tables = torch.randint(0, num_blocks, (len(lens), max(per_seq) + 2), generator=gen)
    query = randn(len(lens), HEADS, head, gen=gen, dtype=dtype)
    keys, values = [], []
    used = 0
    for b, n in enumerate(lens):
        tables[b, : per_seq[b]] = perm[used : used + per_seq[b]]
        used += per_seq[b]
        k = randn(n, KV_HEADS, head, gen=gen, dtype=dtype)
        v = randn(n, KV_HEADS, head, gen=gen, dtype=dtype)
        pos = torch.arange(max(0, n - window) if window else 0, n)
        blocks, offsets = tables[b, pos // block_size], pos % block_size
        key_cache[blocks, offsets] = k[pos]
        value_cache[blocks, offsets] = v[pos]
        keys.append(k)
        values.append(v)
    return query, (key_cache, value_cache), tables, torch.tensor(lens), keys, values


def check_decode(out, query, keys, values, lens, window, cap, tol) -> None:
    assert torch.isfinite(out).all()
    for b, n in enumerate(lens):
        ref = reference(
            query[b : b + 1], keys[b], values[b], torch.tensor([n - 1]), 0.25, window, cap
        )
        torch.testing.assert_close(out[b : b + 1].double(), ref, **tol)


DECODE_LENS = [1, 4, 5, 6, 8, 9, 16, 17, 23, 40, 100]


@pytest.mark.parametrize("window,cap", OPTIONS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_torch_matches_reference(window, cap, block_size, monkeypatch):
    """The pure-torch decode (VLLM_PP_DISABLE_KERNELS=1), windows smaller and larger than a
    block, contexts shorter and longer than the window."""
    set_kernels(monkeypatch, False)
    query, cache, tables, lens, keys, values = decode_case(
        DECODE_LENS, window, block_size, torch.float32, seed=block_size
    )
    out = paged_decode_attention(query, cache, tables, lens, int(lens.max()), 0.25, window, cap)
    check_decode(out, query, keys, values, DECODE_LENS, window, cap, F32_TOL)


@pytest.mark.skipif(not ops._LOADED, reason="vllm._C is not built")
@pytest.mark.parametrize("window,cap", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head", [16, 64])
def test_decode_kernel_matches_reference(window, cap, dtype, head, isa, monkeypatch):
    """The C++ kernel through the layer's dispatch, every ISA, the run-time and a compiled-in
    head size; blocks wholly before a window hold NaN."""
    set_kernels(monkeypatch, True)
    query, cache, tables, lens, keys, values = decode_case(
        DECODE_LENS, window, 4, dtype, seed=head, head=head
    )
    assert ops.supports_attention(query, cache[0])
    out = paged_decode_attention(query, cache, tables, lens, int(lens.max()), 0.25, window, cap)
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    check_decode(out, query, keys, values, DECODE_LENS, window, cap, tol)


@pytest.mark.skipif(not ops._LOADED, reason="vllm._C is not built")
def test_kernel_and_torch_decode_agree_on_many_heads(monkeypatch):
    """Few sequences (the kernel splits them by KV head) and many (one task per sequence)."""
    for batch in (2, 64):
        lens = [(7 * i) % 50 + 1 for i in range(batch)]
        query, cache, tables, lens_t, _, _ = decode_case(lens, 9, 8, torch.float32, seed=batch)
        set_kernels(monkeypatch, True)
        kernel = paged_decode_attention(query, cache, tables, lens_t, max(lens), 0.25, 9, 3.0)
        set_kernels(monkeypatch, False)
        torch_out = paged_decode_attention(query, cache, tables, lens_t, max(lens), 0.25, 9, 3.0)
        torch.testing.assert_close(kernel, torch_out, **F32_TOL)


def _metadata(
    prefills: list[tuple[int, int, list[int]]],
    decodes: list[tuple[int, list[int]]],
    block_size: int,
) -> InputMetadata:
    """InputMetadata of one step: prefills as (context, length, block table), then decodes as
    (context length including the new token, block table)."""

    def slots(table: list[int], positions: range) -> list[int]:
        return [table[p // block_size] * block_size + p % block_size for p in positions]

    slot_mapping: list[int] = []
    for context, length, table in prefills:
        slot_mapping += slots(table, range(context, context + length))
    for n, table in decodes:
        slot_mapping += slots(table, range(n - 1, n))
    width = max([len(t) for *_, t in prefills] + [len(t) for _, t in decodes] + [1])

    def padded(tables: list[list[int]]) -> torch.Tensor:
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)

    return InputMetadata(
        num_prefills=len(prefills),
        num_prefill_tokens=sum(length for _, length, _ in prefills),
        num_decode_tokens=len(decodes),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        prefill_seq_lens=torch.tensor([length for _, length, _ in prefills], dtype=torch.long),
        decode_context_lens=torch.tensor([n for n, _ in decodes], dtype=torch.long),
        decode_block_tables=padded([t for _, t in decodes]).view(len(decodes), width),
        prefill_context_lens=torch.tensor([c for c, _, _ in prefills], dtype=torch.long),
        prefill_block_tables=padded([t for *_, t in prefills]).view(len(prefills), width),
    )


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("window,cap", [(6, None), (6, 2.0), (None, 2.0)])
def test_layer_chunked_prefill_then_decode(window, cap, kernels, monkeypatch):
    """PagedAttention with options: a 30-token prompt prefilled in chunks of 8 (each chunk in
    the same step as another sequence's decode, as chunked prefill schedules them), then
    decoded for 5 steps, equals the reference at every position. The same layer also runs the
    prompt in one piece (the prefix-caching path is the chunk path: a prefill with context)."""
    if kernels and not ops._LOADED:
        pytest.skip("vllm._C is not built")
    set_kernels(monkeypatch, kernels)
    gen = torch.Generator().manual_seed(1)
    block_size, prompt, steps = 4, 30, 5
    total = prompt + steps
    layer = PagedAttention(HEADS, HEAD, 0.25, KV_HEADS, sliding_window=window, logits_soft_cap=cap)
    q = randn(total, HEADS, HEAD, gen=gen)
    k, v = randn(total, KV_HEADS, HEAD, gen=gen), randn(total, KV_HEADS, HEAD, gen=gen)
    ref = reference(q, k, v, torch.arange(total), 0.25, window, cap)
    # A second sequence decoding alongside: 12 tokens already cached.
    q2, k2 = randn(1, HEADS, HEAD, gen=gen), randn(12, KV_HEADS, HEAD, gen=gen)
    v2 = randn(12, KV_HEADS, HEAD, gen=gen)
    ref2 = reference(q2, k2, v2, torch.tensor([11]), 0.25, window, cap)
    shape = (40, block_size, KV_HEADS, HEAD)
    cache = (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
    table = torch.randperm(40, generator=gen)[:10].tolist()  # 9 blocks for 35 tokens, 1 spare
    table2 = [b for b in range(40) if b not in table][:3]
    for p in range(11):  # the decoding sequence's context
        slot = table2[p // block_size] * block_size + p % block_size
        cache[0].view(-1, KV_HEADS, HEAD)[slot] = k2[p]
        cache[1].view(-1, KV_HEADS, HEAD)[slot] = v2[p]

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1)

    outs = []
    for context in range(0, prompt, 8):
        length = min(8, prompt - context)
        s = slice(context, context + length)
        md = _metadata([(context, length, table)], [(12, table2)], block_size)
        out = layer(
            flat(torch.cat([q[s], q2])),
            flat(torch.cat([k[s], k2[11:12]])),
            flat(torch.cat([v[s], v2[11:12]])),
            cache,
            md,
        ).view(-1, HEADS, HEAD)
        outs.append(out[:length])
        torch.testing.assert_close(out[length:].double(), ref2, **F32_TOL)
    for pos in range(prompt, total):
        md = _metadata([], [(pos + 1, table)], block_size)
        s = slice(pos, pos + 1)
        outs.append(layer(flat(q[s]), flat(k[s]), flat(v[s]), cache, md).view(-1, HEADS, HEAD))
    torch.testing.assert_close(torch.cat(outs).double(), ref, **F32_TOL)
    # The whole prompt as one plain prefill (no context): the same result.
    md = _metadata([(0, prompt, table)], [], block_size)
    whole = layer(flat(q[:prompt]), flat(k[:prompt]), flat(v[:prompt]), cache, md)
    torch.testing.assert_close(whole.view(-1, HEADS, HEAD).double(), ref[:prompt], **F32_TOL)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": -4}, "sliding_window"),
        ({"sliding_window": 2.5}, "sliding_window"),
        ({"logits_soft_cap": 0.0}, "logits_soft_cap"),
        ({"logits_soft_cap": -1.0}, "logits_soft_cap"),
    ],
)
def test_bad_options_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedAttention(4, 16, 0.25, 2, **kwargs)


def test_options_default_to_none():
    layer = PagedAttention(4, 16, 0.25, 2)
    assert layer.sliding_window is None and layer.logits_soft_cap is None
    assert "sliding_window=None" in repr(layer)
