"""Prefill attention of a chunk over its cached context (csrc/prefill_attention.cpp) against a
float64 reference, for each instruction-set variant: caches full of NaN outside the context
(a read past it reaches the output), shuffled block tables, chunks that cross the kernel's
query-row tasks and 128-key blocks, GQA, MHA and head sizes 16-128. Also: any thread count
gives the same bits, the attention layer takes the kernel only where it applies, and bad
arguments are refused."""

from __future__ import annotations

import pytest
import torch

from tests.utils.kernel_env import set_kernels
from vllm import _custom_ops as ops
from vllm.model_executor.layers.attention import prefill_attention_with_context

pytestmark = pytest.mark.skipif(not ops.is_available(), reason="C++ kernels not built")

TOL = {"rtol": 1e-5, "atol": 2e-6}


@pytest.fixture(autouse=True)
def _kernels_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kernels(monkeypatch, True)


def _case(
    length: int, context: int, heads: int, kv_heads: int, head_size: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """query [L, H, D] (rows strided as in a fused qkv), caches [blocks, bs, Hkv, D] with the
    sequence's blocks shuffled among spare ones and NaN in every slot past its tokens, and the
    block table."""
    gen = torch.Generator().manual_seed(seed)
    total = context + length
    used = -(-total // block_size)
    num_blocks = used + 5
    shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))
    table = torch.randperm(num_blocks, generator=gen)[:used]
    keys = torch.randn(total, kv_heads, head_size, generator=gen)
    values = torch.randn(total, kv_heads, head_size, generator=gen)
    for t in range(total):
        key_cache[table[t // block_size], t % block_size] = keys[t]
        value_cache[table[t // block_size], t % block_size] = values[t]
    fused = torch.randn(length, (heads + 2 * kv_heads) * head_size, generator=gen)
    query = fused[:, : heads * head_size].view(length, heads, head_size)
    return query, key_cache, value_cache, table


def _reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    context: int,
    scale: float,
) -> torch.Tensor:
    length, heads, head_size = query.shape
    kv_heads = key_cache.shape[2]
    total = context + length
    keys = key_cache[table].reshape(-1, kv_heads, head_size)[:total].double()
    values = value_cache[table].reshape(-1, kv_heads, head_size)[:total].double()
    keys = keys.repeat_interleave(heads // kv_heads, 1)
    values = values.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("lhd,nhd->hln", query.double(), keys) * scale
    visible = torch.arange(total)[None, :] <= (context + torch.arange(length))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hln,nhd->lhd", scores.softmax(-1), values)


# (length, context, heads, kv_heads, head_size, block_size): one token; a chunk inside one key
# block; SmolLM2's GQA across several 32-query tasks and 128-key blocks; MHA at 128 dims; a
# group of 8; a short chunk after a long context; a first chunk (no context).
CASES = [
    (1, 0, 2, 1, 16, 16),
    (7, 5, 9, 3, 64, 16),
    (100, 300, 9, 3, 64, 16),
    (130, 65, 8, 8, 128, 8),
    (45, 129, 8, 1, 32, 32),
    (5, 1000, 6, 2, 64, 16),
    (97, 0, 9, 3, 64, 16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "L{}-ctx{}-H{}-Hkv{}-D{}-bs{}".format(*c))
def test_matches_float64(case: tuple[int, ...], isa: str) -> None:
    query, key_cache, value_cache, table = _case(*case, seed=sum(case))
    context, scale = case[1], case[4] ** -0.5
    out = ops.prefill_attention_paged(query, key_cache, value_cache, table, context, scale)
    assert torch.isfinite(out).all()
    expected = _reference(query, key_cache, value_cache, table, context, scale)
    torch.testing.assert_close(out.double(), expected, **TOL)


def test_one_position_off_is_caught() -> None:
    """The comparison is sharp: the same chunk one position later (one more key each) is far
    outside the tolerance."""
    query, key_cache, value_cache, table = _case(40, 60, 9, 3, 64, 16, seed=5)
    key_cache, value_cache = key_cache.nan_to_num(0.5), value_cache.nan_to_num(0.5)
    out = ops.prefill_attention_paged(query, key_cache, value_cache, table, 60, 0.125)
    shifted = _reference(query, key_cache, value_cache, table, 61, 0.125)
    assert not torch.allclose(out.double(), shifted, **TOL)


def test_large_scores_stay_finite() -> None:
    """Scores in the hundreds overflow exp() unless each row's running maximum is subtracted."""
    query, key_cache, value_cache, table = _case(50, 200, 9, 3, 64, 16, seed=9)
    query = query * 40.0
    out = ops.prefill_attention_paged(query, key_cache, value_cache, table, 200, 0.125)
    assert torch.isfinite(out).all()
    expected = _reference(query, key_cache, value_cache, table, 200, 0.125)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_thread_count_gives_the_same_bits() -> None:
    query, key_cache, value_cache, table = _case(200, 150, 9, 3, 64, 16, seed=3)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(ops.prefill_attention_paged(query, key_cache, value_cache, table, 150, 0.1))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1])


def test_layer_function_takes_the_kernel_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """prefill_attention_with_context gives SDPA's result through the kernel; a sliding window,
    a soft-cap or bf16 keep SDPA (the kernel does neither)."""
    query, key_cache, value_cache, table = _case(64, 100, 9, 3, 64, 16, seed=1)
    calls = []
    real = ops.prefill_attention_paged

    def spy(*args: object) -> torch.Tensor:
        calls.append(args)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "prefill_attention_paged", spy)
    got = prefill_attention_with_context(query, (key_cache, value_cache), table, 100, 0.125)
    assert len(calls) == 1
    set_kernels(monkeypatch, False)
    sdpa = prefill_attention_with_context(query, (key_cache, value_cache), table, 100, 0.125)
    torch.testing.assert_close(got, sdpa, **TOL)
    set_kernels(monkeypatch, True)
    assert not ops.supports_prefill_attention(query, key_cache, 32, None)
    assert not ops.supports_prefill_attention(query, key_cache, None, 30.0)
    assert not ops.supports_prefill_attention(query.bfloat16(), key_cache.bfloat16(), None, None)
    assert not ops.supports_prefill_attention(query[..., :40], key_cache[..., :40], None, None)
    prefill_attention_with_context(query, (key_cache, value_cache), table, 100, 0.125, 32)
    assert len(calls) == 1


def test_bad_arguments_are_refused() -> None:
    query, key_cache, value_cache, table = _case(8, 20, 4, 2, 32, 16, seed=2)
    op = torch.ops.vllm_pp.prefill_attention_paged
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="block 99 is outside the cache"):
        op(out, query, key_cache, value_cache, torch.tensor([0, 99]), 20, 0.1)
    with pytest.raises(RuntimeError, match="block_table must be"):
        op(out, query, key_cache, value_cache, table[:1], 20, 0.1)
    with pytest.raises(RuntimeError, match="query must be float32"):
        op(out, query.double(), key_cache, value_cache, table, 20, 0.1)
    with pytest.raises(RuntimeError, match="3 KV heads"):
        bad = torch.zeros(key_cache.shape[0], 16, 3, 32)
        op(out, query, bad, bad, table, 20, 0.1)
