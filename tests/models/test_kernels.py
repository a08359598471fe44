"""The C++ CPU kernels (csrc/, vllm._C) against the torch fallback and a float64 reference.

Every case builds a paged cache full of NaN (uninitialised memory), writes real K/V only into
the slots of each sequence's context through shuffled, non-contiguous block tables, and checks
the kernel output against the torch fallback of vllm/model_executor/layers/attention.py: a read
past a context length brings NaN into the output, a read short of it changes the result by far
more than the tolerance.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from tests.utils.kernel_env import set_kernels
from vllm import _custom_ops as ops
from vllm.model_executor.layers.attention import paged_decode_attention, write_to_kv_cache

pytestmark = pytest.mark.skipif(
    not ops._LOADED,
    reason="vllm._C is not built (run `pip install --no-deps --no-build-isolation -e .`)",
)

# (num_heads, num_kv_heads, head_size): SmolLM2 GQA, a small GQA, MHA, and a head size with a
# tail that is not a whole AVX-512 vector.
LAYOUTS = [(9, 3, 64), (4, 2, 16), (8, 8, 128), (6, 2, 40)]
BLOCK_SIZES = [8, 16, 32]
BATCH_SIZES = [1, 2, 7, 33]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _kernels_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kernels(monkeypatch, True)


@dataclass
class DecodeCase:
    query: torch.Tensor  # [B, H, D], rows strided like the model's q slice of a fused qkv
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], NaN outside the contexts
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int64
    context_lens: torch.Tensor  # [B] int64
    scale: float


def _context_lens(batch: int, block_size: int, gen: torch.Generator) -> list[int]:
    """1, around block boundaries, long, and random: shuffled and cycled over the batch."""
    special = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1]
    special += [int(torch.randint(300, 700, (1,), generator=gen)) for _ in range(2)]
    special += [int(torch.randint(1, 100, (1,), generator=gen)) for _ in range(2)]
    order = torch.randperm(len(special), generator=gen).tolist()
    return [special[order[i % len(special)]] for i in range(batch)]


def make_decode_case(
    batch: int,
    layout: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    lens: list[int] | None = None,
    logit_scale: float = 1.0,
) -> DecodeCase:
    num_heads, num_kv_heads, head_size = layout
    gen = torch.Generator().manual_seed(seed)
    lens = lens if lens is not None else _context_lens(batch, block_size, gen)
    blocks_per_seq = [math.ceil(n / block_size) for n in lens]
    max_blocks = max(blocks_per_seq) + 2  # padding columns the kernel must not need
    num_blocks = sum(blocks_per_seq) + 5  # spare blocks that stay NaN
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    # Every sequence gets distinct blocks in a random order; padding entries point anywhere
    # (at other sequences' blocks or NaN ones), as stale table entries would.
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (batch, max_blocks), generator=gen)
    start = 0
    for b, n_blocks in enumerate(blocks_per_seq):
        tables[b, :n_blocks] = perm[start : start + n_blocks]
        start += n_blocks
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        blocks, offsets = tables[b, pos // block_size], pos % block_size
        for cache in (key_cache, value_cache):
            rows = torch.randn(n, num_kv_heads, head_size, generator=gen)
            cache[blocks, offsets] = rows.to(dtype)
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(batch, width, generator=gen) * logit_scale
    query = qkv.to(dtype)[:, : num_heads * head_size].view(batch, num_heads, head_size)
    return DecodeCase(
        query, key_cache, value_cache, tables, torch.tensor(lens), 1.0 / math.sqrt(head_size)
    )


def run_kernel(case: DecodeCase) -> torch.Tensor:
    return ops.paged_attention_decode(
        case.query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.context_lens,
        case.scale,
    )


def run_fallback(case: DecodeCase, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    set_kernels(monkeypatch, False)
    try:
        assert not ops.is_available()
        return paged_decode_attention(
            case.query,
            (case.key_cache, case.value_cache),
            case.block_tables,
            case.context_lens,
            int(case.context_lens.max()),
            case.scale,
        )
    finally:
        set_kernels(monkeypatch, True)


def run_reference(case: DecodeCase) -> torch.Tensor:
    """Float64, one sequence at a time, from the slots each of its tokens occupies."""
    batch, num_heads, head_size = case.query.shape
    block_size, num_kv_heads = case.key_cache.shape[1], case.key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(batch, num_heads, head_size, dtype=torch.float64)
    for b in range(batch):
        pos = torch.arange(int(case.context_lens[b]))
        blocks, offsets = case.block_tables[b, pos // block_size], pos % block_size
        keys = case.key_cache[blocks, offsets].double()  # [n, Hkv, D]
        values = case.value_cache[blocks, offsets].double()
        q = case.query[b].double().view(num_kv_heads, group, head_size)
        probs = torch.softmax(torch.einsum("kgd,nkd->kgn", q, keys) * case.scale, dim=-1)
        out[b] = torch.einsum("kgn,nkd->kgd", probs, values).reshape(num_heads, head_size)
    return out


# Cases with their fallback and reference outputs, shared by the runs of every ISA variant.
_EXPECTED: dict[tuple, tuple[DecodeCase, torch.Tensor, torch.Tensor]] = {}


def case_with_expected(
    monkeypatch: pytest.MonkeyPatch, *args, **kwargs
) -> tuple[DecodeCase, torch.Tensor, torch.Tensor]:
    """make_decode_case(*args, **kwargs) and its (fallback, reference) outputs, memoised."""
    key = (args, tuple(sorted(kwargs.items())))
    if key not in _EXPECTED:
        # One thread: these small ops only lose to OpenMP barriers on a busy machine.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            case = make_decode_case(*args, **kwargs)
            _EXPECTED[key] = (case, run_fallback(case, monkeypatch), run_reference(case))
        finally:
            torch.set_num_threads(threads)
    return _EXPECTED[key]


# fp32: both implementations round differently (summation order, exp), never by more than this.
F32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16: the kernel accumulates in fp32 and rounds once at the end (half an ulp of bf16, 2^-9);
# the torch fallback also rounds scores and probabilities to bf16 on the way.
BF16_TOL_REFERENCE = dict(rtol=8e-3, atol=8e-3)
BF16_TOL_FALLBACK = dict(rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "H{}-Hkv{}-D{}".format(*x))
@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_decode_matches_fallback(
    batch: int,
    layout: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    isa: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case, fallback, reference = case_with_expected(
        monkeypatch, batch, layout, block_size, dtype, seed=batch * 1000 + block_size
    )
    out = run_kernel(case)
    assert out.shape == case.query.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "uninitialised (NaN) cache memory leaked into the output"
    if dtype == torch.float32:
        torch.testing.assert_close(out, fallback, **F32_TOL)
        torch.testing.assert_close(out.double(), reference, **F32_TOL)
    else:
        torch.testing.assert_close(out.double(), reference, **BF16_TOL_REFERENCE)
        torch.testing.assert_close(out.float(), fallback.float(), **BF16_TOL_FALLBACK)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 3, 8, 9, 33])
def test_decode_thread_splits(batch: int, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Few sequences are split by KV head across threads, many are not: same result."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = make_decode_case(batch, (9, 3, 64), 16, torch.float32, seed=7 + batch)
        out = run_kernel(case)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(out, run_fallback(case, monkeypatch), **F32_TOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_decode_large_logits(dtype: torch.dtype, isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores in the hundreds overflow exp() unless the maximum is subtracted first."""
    case, _, reference = case_with_expected(
        monkeypatch, 5, (9, 3, 64), 16, dtype, seed=3, logit_scale=40.0
    )
    out = run_kernel(case)
    assert torch.isfinite(out).all()
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL_REFERENCE
    torch.testing.assert_close(out.double(), reference, **tol)


def test_decode_detects_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is sharp enough: one token more or less is far outside the tolerance."""
    case = make_decode_case(4, (9, 3, 64), 16, torch.float32, seed=11, lens=[1, 16, 17, 500])
    out = run_kernel(case)
    for delta in (-1, 1):
        shifted = DecodeCase(**{**case.__dict__, "context_lens": case.context_lens + delta})
        # The slots past each context hold NaN: fill them so that "one more" is a real token.
        shifted.key_cache = torch.nan_to_num(case.key_cache, nan=0.5)
        shifted.value_cache = torch.nan_to_num(case.value_cache, nan=0.5)
        if delta < 0:
            shifted.context_lens = shifted.context_lens.clamp(min=1)
        other = run_reference(shifted).float()
        assert not torch.allclose(out[1:], other[1:], **F32_TOL)


def test_decode_via_attention_layer_uses_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """paged_decode_attention dispatches to the kernel when available, else the torch path."""
    case = make_decode_case(3, (4, 2, 16), 8, torch.float32, seed=5)
    args = (
        case.query,
        (case.key_cache, case.value_cache),
        case.block_tables,
        case.context_lens,
        int(case.context_lens.max()),
        case.scale,
    )
    direct = run_kernel(case)
    calls: list[int] = []
    real = ops.paged_attention_decode
    monkeypatch.setattr(ops, "paged_attention_decode", lambda *a: calls.append(1) or real(*a))
    via_layer = paged_decode_attention(*args)
    assert calls == [1]
    torch.testing.assert_close(via_layer, direct, rtol=0, atol=0)
    set_kernels(monkeypatch, False)
    paged_decode_attention(*args)
    assert calls == [1]
    # Unsupported dtype: silently the torch path.
    set_kernels(monkeypatch, True)
    half = (case.key_cache.half(), case.value_cache.half())
    paged_decode_attention(case.query.half(), half, *args[2:])
    assert calls == [1]


def test_decode_rejects_bad_tables() -> None:
    case = make_decode_case(2, (4, 2, 16), 8, torch.float32, seed=1, lens=[5, 20])
    bad = case.block_tables.clone()
    bad[1, 1] = case.key_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        run_kernel(DecodeCase(**{**case.__dict__, "block_tables": bad}))
    too_long = torch.tensor([5, case.block_tables.shape[1] * 8 + 1])
    with pytest.raises(RuntimeError, match="context_lens"):
        run_kernel(DecodeCase(**{**case.__dict__, "context_lens": too_long}))


def test_decode_empty_context_gives_zeros() -> None:
    case = make_decode_case(2, (4, 2, 16), 8, torch.float32, seed=2, lens=[5, 9])
    case.context_lens = torch.tensor([0, 9])
    out = run_kernel(case)
    assert (out[0] == 0).all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 13, 64])
def test_write_to_kv_cache_matches_index_copy(
    num_tokens: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    num_blocks, block_size, num_kv_heads, head_size = 12, 8, 3, 16
    gen = torch.Generator().manual_seed(num_tokens)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    # Strided K/V rows, as sliced out of a fused qkv projection.
    kv = torch.randn(num_tokens, 3 * num_kv_heads * head_size, generator=gen).to(dtype)
    key = kv[:, : num_kv_heads * head_size].view(num_tokens, num_kv_heads, head_size)
    value = kv[:, num_kv_heads * head_size : 2 * num_kv_heads * head_size].view(
        num_tokens, num_kv_heads, head_size
    )
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]

    expected = (key_cache.clone(), value_cache.clone())
    set_kernels(monkeypatch, False)
    write_to_kv_cache(key, value, expected, slots)
    set_kernels(monkeypatch, True)
    got = (key_cache.clone(), value_cache.clone())
    write_to_kv_cache(key, value, got, slots)  # dispatches to the kernel
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert not torch.equal(got[0], key_cache) or num_tokens == 0


def test_write_to_kv_cache_skips_negative_slots() -> None:
    shape = (4, 8, 2, 16)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, -1, 30])
    ops.write_to_kv_cache(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(-1, 2, 16), value_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_k[30], key[2])
    assert torch.equal(flat_v[5], value[0]) and torch.equal(flat_v[30], value[2])
    written = torch.zeros(32, dtype=torch.bool)
    written[[5, 30]] = True
    assert (flat_k[~written] == 0).all() and (flat_v[~written] == 0).all()


def test_write_to_kv_cache_rejects_bad_slot_untouched() -> None:
    shape = (2, 4, 1, 8)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    key, value = torch.ones(2, 1, 8), torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.write_to_kv_cache(key, value, key_cache, value_cache, torch.tensor([1, 8]))
    assert (key_cache == 0).all() and (value_cache == 0).all()


def test_disable_env_forces_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ops.is_available()
    monkeypatch.setenv(ops.DISABLE_ENV, "1")
    assert ops.is_available()  # read once: a change takes effect when read again
    ops.reset_availability()
    assert not ops.is_available()
    assert not ops.supports_attention(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1))


def test_isa_names() -> None:
    assert ops.cpu_isa() in ("generic", "avx2", "avx512")
    with pytest.raises(ValueError):
        ops.set_cpu_isa("sse9")


def test_decode_grid_covers_block_boundaries() -> None:
    """The length generator really produces the edge cases the tests rely on."""
    gen = torch.Generator().manual_seed(0)
    lens = set(itertools.chain.from_iterable(_context_lens(33, 16, gen) for _ in range(1)))
    assert {1, 15, 16, 17, 32}.issubset(lens) and max(lens) >= 300
