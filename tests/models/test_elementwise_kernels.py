"""The fused elementwise C++ kernels (csrc/elementwise.cpp: RMSNorm, fused add + RMSNorm, RoPE,
SiLU-and-mul) against the torch code of the layers they replace, run with the kernels disabled.

Every case runs on each instruction-set variant the CPU has (the `isa` fixture), with strided
rows (column slices of a wider buffer, as the model's q/k are of the fused qkv), sizes that are
not a multiple of any vector width, and 1, 3 and 33 tokens.

What "matches" means, per kernel:
  - rotary_embedding and the residual sum of fused_add_rms_norm repeat torch's roundings step
    by step: bit-identical in float32 and bfloat16.
  - rms_norm sums the squares in another order than torch's reduction, so 1/rms differs by an
    ulp or two: float32 results a few ulps apart (rtol 1e-6); in bfloat16 the normalised value
    (rounded to bf16 before the weight multiplies it) is at most one bf16 ulp off, rarely, and
    the output is exactly weight times it.
  - silu_and_mul computes exp with a polynomial, not torch's SLEEF: float32 within 4 ulps of
    torch (each within 3 ulps of the exact value; rtol 1e-6), and bfloat16 bit-identical (silu
    of every one of the 65536 bf16 values rounds like torch's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from tests.utils.kernel_env import set_kernels
from vllm import _custom_ops as ops
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not ops._LOADED,
    reason="vllm._C is not built (run `pip install --no-deps --no-build-isolation -e .`)",
)

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
NUM_TOKENS = [1, 3, 33]
HIDDEN_SIZES = [40, 72, 576]  # 576 = SmolLM2; 40 and 72 leave tails for every vector width
HEAD_SIZES = [64, 40, 128]
INTERMEDIATE_SIZES = [40, 72, 1536]
EPS = 1e-5
# float32, for the kernels that cannot round exactly like torch (see the module docstring).
F32_TOL = dict(rtol=1e-6, atol=1e-6)
# bfloat16 RMSNorm: share of normalised values allowed to be one ulp off.
BF16_MAX_ULP_SHARE = 0.01


@pytest.fixture(autouse=True)
def _kernels_enabled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    set_kernels(monkeypatch, True)
    # One thread: these small ops only lose to OpenMP barriers on a busy machine (the thread
    # split has its own test).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextmanager
def torch_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within it, the layers take their torch fallback."""
    set_kernels(monkeypatch, False)
    assert not ops.is_available()
    yield
    set_kernels(monkeypatch, True)


def strided_rows(
    num_tokens: int, width: int, dtype: torch.dtype, scale: float, seed: int
) -> torch.Tensor:
    """A [T, width] view with a row stride larger than width (a column slice of a buffer)."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(num_tokens, width + 24, generator=gen) * scale
    view = buf.to(dtype)[:, 8 : 8 + width]
    assert view.stride(0) == width + 24 and view.stride(1) == 1
    return view


def ordered(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns mapped to integers that are consecutive for adjacent floats (±0 -> 0), so
    that the difference of two is their distance in ulps."""
    if x.dtype == torch.bfloat16:
        bits = x.view(torch.int16).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered(a) - ordered(b)).abs()


def bf16_step(x: torch.Tensor, steps: int) -> torch.Tensor:
    """x moved by `steps` bf16 ulps (across zero too)."""
    o = ordered(x) + steps
    bits = torch.where(o < 0, (-o) | 0x8000, o)
    return bits.to(torch.int16).view(torch.bfloat16)


def assert_bf16_rms_norm(
    out: torch.Tensor, expected: torch.Tensor, h: torch.Tensor, weight: torch.Tensor
) -> None:
    """out is HF's `weight * normed` exactly, where normed (h * rsqrt(var + eps) rounded to
    bf16) may be one ulp off torch's because the variance sums in another order; rarely.
    (The output itself can then be two ulps off: weight * normed rounds again.)"""
    h = h.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    candidates = [weight * bf16_step(normed, step) for step in (0, -1, 1)]
    assert torch.equal(candidates[0], expected)  # the torch path, step by step
    exact = out == expected
    assert (exact | (out == candidates[1]) | (out == candidates[2])).all()
    share = 1 - exact.float().mean().item()
    assert share <= BF16_MAX_ULP_SHARE, f"{share:.2%} of the rows' values are one ulp off"


def assert_rms_norm_matches(
    out: torch.Tensor, expected: torch.Tensor, h: torch.Tensor, weight: torch.Tensor
) -> None:
    """fp32: within F32_TOL of the torch path; bf16: as assert_bf16_rms_norm says."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, **F32_TOL)
    else:
        assert_bf16_rms_norm(out, expected, h, weight)


def make_norm(hidden: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, EPS).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=gen))
    return norm


# ---- RMSNorm ------------------------------------------------------------------------------


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rms_norm_matches_fallback(
    num_tokens: int, hidden: int, dtype: torch.dtype, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    norm = make_norm(hidden, dtype, seed=hidden)
    x = strided_rows(num_tokens, hidden, dtype, scale=3.0, seed=num_tokens)
    with torch_path(monkeypatch):
        expected = norm(x)
    out = norm(x)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert_rms_norm_matches(out, expected, x, norm.weight)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_fused_add_rms_norm_matches_fallback(
    num_tokens: int, hidden: int, dtype: torch.dtype, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    norm = make_norm(hidden, dtype, seed=hidden + 1)
    x = strided_rows(num_tokens, hidden, dtype, scale=1.0, seed=num_tokens)
    residual = strided_rows(num_tokens, hidden, dtype, scale=4.0, seed=num_tokens + 100)
    with torch_path(monkeypatch):
        expected_out, expected_sum = norm(x, residual)
    x_in, res_in = x.clone(), residual.clone()  # the kernel works in place
    got_x, got_res = x.clone(), residual.clone()
    out, new_residual = norm(got_x, got_res)
    assert out is got_x and new_residual is got_res  # in place, as returned
    assert torch.equal(x, x_in) and torch.equal(residual, res_in)  # the fallback left them
    # The add is one correctly rounded op in both: bit-identical.
    assert torch.equal(new_residual, expected_sum)
    assert_rms_norm_matches(out, expected_out, expected_sum, norm.weight)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_add_rms_norm_equals_add_then_rms_norm(dtype: torch.dtype, isa: str) -> None:
    """Bitwise: fusing the add changes nothing. A pipeline stage boundary materialises the sum
    and the next stage runs the plain norm on it; its output must not depend on the split."""
    weight = (1 + torch.randn(576)).to(dtype)
    x = strided_rows(33, 576, dtype, scale=1.0, seed=1)
    residual = strided_rows(33, 576, dtype, scale=3.0, seed=2)
    unfused = ops.rms_norm(residual + x, weight, EPS)
    fx, fr = x.clone(), residual.clone()
    ops.fused_add_rms_norm(fx, fr, weight, EPS)
    assert torch.equal(fr, residual + x) and torch.equal(fx, unfused)


@torch.inference_mode()
def test_rms_norm_strided_rows_in_place_of_a_wider_buffer() -> None:
    """fused_add_rms_norm on strided views writes only their columns."""
    buf_x = torch.randn(5, 100)
    buf_r = torch.randn(5, 100)
    before_x, before_r = buf_x.clone(), buf_r.clone()
    weight = torch.randn(72)
    ops.fused_add_rms_norm(buf_x[:, 10:82], buf_r[:, 20:92], weight, EPS)
    outside_x = torch.ones(5, 100, dtype=torch.bool)
    outside_x[:, 10:82] = False
    outside_r = torch.ones(5, 100, dtype=torch.bool)
    outside_r[:, 20:92] = False
    assert torch.equal(buf_x[outside_x], before_x[outside_x])
    assert torch.equal(buf_r[outside_r], before_r[outside_r])
    assert torch.equal(buf_r[:, 20:92], before_r[:, 20:92] + before_x[:, 10:82])


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_nan_stays_in_its_row(
    dtype: torch.dtype, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    norm = make_norm(72, dtype, seed=3)
    x = strided_rows(4, 72, dtype, scale=1.0, seed=3).clone()
    x[1, 70] = float("nan")  # in the tail of every vector width
    x[2, 5] = float("inf")  # rsqrt(inf) = 0: the row is 0, but inf * 0 = NaN (torch too)
    with torch_path(monkeypatch):
        expected = norm(x)
    out = norm(x)
    assert torch.equal(out.isnan(), expected.isnan())
    assert out[1].isnan().all()
    assert out[2, 5].isnan() and (out[2, :5] == 0).all() and (out[2, 6:] == 0).all()
    assert torch.isfinite(out[[0, 3]]).all()
    torch.testing.assert_close(out[[0, 3]], expected[[0, 3]], rtol=1e-2, atol=0)


# ---- Rotary embedding ---------------------------------------------------------------------


def make_qkv(
    num_tokens: int, heads: tuple[int, int], head_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv, q, k): a fused [T, (H + 2 Hkv) D] projection output and its q and k column
    slices."""
    num_heads, num_kv_heads = heads
    width = (num_heads + 2 * num_kv_heads) * head_size
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, width, generator=gen) * 2).to(dtype)
    q = qkv[:, : num_heads * head_size]
    k = qkv[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size]
    return qkv, q, k


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rotary_matches_fallback_exactly(
    num_tokens: int,
    head_size: int,
    dtype: torch.dtype,
    isa: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    max_position = 4096
    rope = RotaryEmbedding(head_size, max_position, base=10000.0)
    gen = torch.Generator().manual_seed(head_size + num_tokens)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    positions[0] = max_position - 1  # the last row of the caches
    qkv, q, k = make_qkv(num_tokens, (9, 3), head_size, dtype, seed=num_tokens)
    with torch_path(monkeypatch):
        expected_q, expected_k = rope(positions, q, k)
    v_before = qkv[:, q.shape[1] + k.shape[1] :].clone()
    out_q, out_k = rope(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    assert torch.equal(qkv[:, q.shape[1] + k.shape[1] :], v_before)  # v untouched


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_propagates_nan_like_torch(
    dtype: torch.dtype, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rope = RotaryEmbedding(40, 64)
    _, q, k = make_qkv(3, (2, 1), 40, dtype, seed=5)
    q[1, 3] = float("nan")  # reaches out[3] and its partner out[23]
    k[2, 39] = float("inf")
    with torch_path(monkeypatch):
        expected_q, expected_k = rope(torch.tensor([0, 7, 63]), q, k)
    out_q, out_k = rope(torch.tensor([0, 7, 63]), q.clone(), k.clone())
    torch.testing.assert_close(out_q, expected_q, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out_k, expected_k, rtol=0, atol=0, equal_nan=True)
    assert out_q[1].isnan().sum() == 2


@pytest.mark.parametrize("bad", [-1, 64, 1 << 40])
def test_rotary_rejects_positions_out_of_range(bad: int) -> None:
    rope = RotaryEmbedding(16, 64)
    _, q, k = make_qkv(3, (2, 1), 16, torch.float32, seed=1)
    q_before, k_before = q.clone(), k.clone()
    with pytest.raises(RuntimeError, match=r"positions\[2\] = .* out of range \[0, 64\)"):
        ops.rotary_embedding(torch.tensor([0, 5, bad]), q, k, 16, rope.cos_cache, rope.sin_cache)
    # Checked before any row is rotated.
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


# ---- SiLU and mul -------------------------------------------------------------------------


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("inter", INTERMEDIATE_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_silu_and_mul_matches_fallback(
    num_tokens: int, inter: int, dtype: torch.dtype, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    act = SiluAndMul()
    x = strided_rows(num_tokens, 2 * inter, dtype, scale=4.0, seed=inter + num_tokens)
    with torch_path(monkeypatch):
        expected = act(x)
    # The kernel itself: SiluAndMul keeps bf16 on torch (faster there), fp32 on the kernel.
    out = ops.silu_and_mul(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float32:
        assert torch.equal(act(x), out)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, **F32_TOL)
        assert ulps(out, expected).max() <= 4
    else:
        assert torch.equal(out, expected)


@torch.inference_mode()
def test_silu_float32_within_ulps_over_the_whole_range(isa: str) -> None:
    """silu(g) (up = 1) on a dense grid: within 4 ulps of torch everywhere, including the far
    negative tail where exp(-g) approaches overflow (silu ~ -1e-37) and beyond it (-0)."""
    gate = torch.linspace(-110.0, 110.0, 400_003)
    x = torch.stack([gate, torch.ones_like(gate)], dim=1)  # rows (gate, up), I = 1
    out = ops.silu_and_mul(x).view(-1)
    expected = F.silu(gate)
    assert ulps(out, expected).max() <= 4
    assert torch.equal(out == 0, expected == 0)
    assert (expected[gate < -88.0] != 0).any() and (expected[gate < -89.0] == 0).all()


@torch.inference_mode()
def test_silu_bfloat16_identical_for_every_input(isa: str) -> None:
    """silu of each of the 65536 bf16 values, rounded to bf16, is torch's (up = 1)."""
    gate = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    gate = gate.view(torch.bfloat16)
    x = torch.stack([gate, torch.ones_like(gate)], dim=1)
    out = ops.silu_and_mul(x).view(-1)
    expected = F.silu(gate)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan], expected[~nan])


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul_special_values(dtype: torch.dtype, isa: str) -> None:
    inf, nan = float("inf"), float("nan")
    gate = torch.tensor([0.0, -0.0, inf, -inf, nan, 1.0, -1.0, 100.0, -100.0, 3.0, 2.0, -2.0])
    up = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, nan, inf, 2.0, 2.0, 0.0, -inf, 1.0])
    x = torch.cat([gate, up]).to(dtype)[None, :]
    out = ops.silu_and_mul(x)[0]
    expected = F.silu(gate.to(dtype)) * up.to(dtype)
    assert torch.equal(out.isnan(), expected.isnan()), (out, expected)
    number = ~expected.isnan()
    if dtype == torch.float32:
        torch.testing.assert_close(out[number], expected[number], rtol=1e-6, atol=0)
    else:
        assert torch.equal(out[number], expected[number])


# ---- Threads, layers, argument checks -----------------------------------------------------


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_thread_split_gives_identical_rows(dtype: torch.dtype) -> None:
    """2048 rows go parallel (a decode batch does not): rows are independent, so the result is
    bitwise that of one thread."""
    hidden, head_size = 576, 64
    x = strided_rows(2048, hidden, dtype, scale=2.0, seed=11)
    residual = strided_rows(2048, hidden, dtype, scale=2.0, seed=12)
    weight = torch.randn(hidden).to(dtype)
    gate_up = strided_rows(2048, 2 * 96, dtype, scale=3.0, seed=13)
    rope = RotaryEmbedding(head_size, 4096)
    positions = torch.randint(0, 4096, (2048,), generator=torch.Generator().manual_seed(0))

    def run() -> list[torch.Tensor]:
        _, q, k = make_qkv(2048, (9, 3), head_size, dtype, seed=14)
        ops.rotary_embedding(positions, q, k, head_size, rope.cos_cache, rope.sin_cache)
        fx, fr = x.clone(), residual.clone()
        ops.fused_add_rms_norm(fx, fr, weight, EPS)
        return [ops.rms_norm(x, weight, EPS), fx, fr, ops.silu_and_mul(gate_up), q, k]

    one = run()
    torch.set_num_threads(2)
    two = run()
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_layers_dispatch_to_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers call the kernels for CPU float32/bfloat16, the torch code otherwise (another
    dtype, or VLLM_PP_DISABLE_KERNELS=1, read again after set_kernels)."""
    calls: list[str] = []
    for name in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"):
        real = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)
        )
    norm, act, rope = RMSNorm(16, EPS), SiluAndMul(), RotaryEmbedding(16, 32)
    positions = torch.arange(3)

    def run_all(dtype: torch.dtype) -> None:
        x = torch.randn(3, 16).to(dtype)
        norm.to(dtype)(x)
        norm(x.clone(), x.clone())
        act(torch.randn(3, 32).to(dtype))
        _, q, k = make_qkv(3, (2, 1), 16, dtype, seed=0)
        rope(positions, q, k)

    run_all(torch.float32)
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"]
    calls.clear()
    run_all(torch.float16)
    assert calls == []
    set_kernels(monkeypatch, False)
    run_all(torch.float32)
    assert calls == []
    assert not ops.supports_elementwise(torch.zeros(1))


@torch.inference_mode()
def test_rms_norm_with_residual_returns_the_sum_on_both_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    norm = make_norm(40, torch.float32, seed=0)
    x, residual = torch.randn(3, 40), torch.randn(3, 40)
    expected_sum = residual + x
    with torch_path(monkeypatch):
        out_t, sum_t = norm(x, residual)
    out_k, sum_k = norm(x.clone(), residual.clone())
    assert torch.equal(sum_t, expected_sum) and torch.equal(sum_k, expected_sum)
    torch.testing.assert_close(out_k, out_t, **F32_TOL)
    torch.testing.assert_close(out_t, norm(expected_sum), **F32_TOL)


def test_kernels_reject_bad_arguments() -> None:
    x, weight = torch.randn(3, 16), torch.randn(16)
    out = torch.empty(3, 16)
    rms = torch.ops.vllm_pp.rms_norm
    with pytest.raises(RuntimeError, match="dtype must be float32 or bfloat16"):
        rms(out.half(), x.half(), weight.half(), EPS)
    with pytest.raises(RuntimeError, match="weight dtype"):
        rms(out, x, weight.bfloat16(), EPS)
    with pytest.raises(RuntimeError, match="weight must be a contiguous \\[16\\]"):
        rms(out, x, torch.randn(8), EPS)
    with pytest.raises(RuntimeError, match="unit last stride"):
        rms(out, torch.randn(16, 3).t(), weight, EPS)
    with pytest.raises(RuntimeError, match="must be 2-D"):
        rms(out, x[None], weight, EPS)
    with pytest.raises(RuntimeError, match="residual .* must match x"):
        torch.ops.vllm_pp.fused_add_rms_norm(x, torch.randn(4, 16), weight, EPS)
    with pytest.raises(RuntimeError, match="x must be \\[T, 2\\*I\\]"):
        torch.ops.vllm_pp.silu_and_mul(torch.empty(3, 3), torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="out must be \\[3, 8\\]"):
        torch.ops.vllm_pp.silu_and_mul(torch.empty(3, 7), torch.randn(3, 16))
    rope = RotaryEmbedding(16, 8)
    q, k = torch.randn(2, 32), torch.randn(2, 16)
    rotary = torch.ops.vllm_pp.rotary_embedding
    positions = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="multiples of head_size"):
        rotary(positions, torch.randn(2, 24), k, 16, rope.cos_cache, rope.sin_cache)
    with pytest.raises(RuntimeError, match="cos/sin caches must be contiguous float32"):
        rotary(positions, q, k, 16, rope.cos_cache.bfloat16(), rope.sin_cache)
    with pytest.raises(RuntimeError, match="one row per position"):
        rotary(torch.tensor([0, 1, 2]), q, k, 16, rope.cos_cache, rope.sin_cache)
    with pytest.raises(RuntimeError, match="positions must be a contiguous int64"):
        rotary(positions.int(), q, k, 16, rope.cos_cache, rope.sin_cache)
    with pytest.raises(RuntimeError, match="key dtype"):
        rotary(positions, q, k.bfloat16(), 16, rope.cos_cache, rope.sin_cache)


@torch.inference_mode()
def test_empty_batches_are_no_ops() -> None:
    weight = torch.randn(16)
    assert ops.rms_norm(torch.empty(0, 16), weight, EPS).shape == (0, 16)
    ops.fused_add_rms_norm(torch.empty(0, 16), torch.empty(0, 16), weight, EPS)
    assert ops.silu_and_mul(torch.empty(0, 32)).shape == (0, 16)
    rope = RotaryEmbedding(16, 8)
    ops.rotary_embedding(
        torch.empty(0, dtype=torch.long),
        torch.empty(0, 32),
        torch.empty(0, 16),
        16,
        rope.cos_cache,
        rope.sin_cache,
    )
