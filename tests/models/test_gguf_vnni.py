"""The int8-activation GGUF kernel (csrc/quant_gguf_vnni.cpp) against a numpy reference that
quantizes the activations the same way and does the integer dot products exactly, on every
ISA (the AVX-512 VNNI kernel and the scalar one), for Q4_0, Q4_1 and Q8_0."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.utils import gguf_q8
from vllm import _custom_ops as ops
from vllm.model_executor.layers.quantization import gguf as gguf_quant

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]

needs_kernels = pytest.mark.skipif(not ops.is_available(), reason="C++ kernels not built")


@pytest.fixture
def restore_isa():
    yield
    if ops.is_available():
        ops.set_cpu_isa(ops.supported_isas()[-1])


def activations(tokens: int, cols: int, seed: int) -> torch.Tensor:
    """Random x [tokens, cols] with a few awkward blocks: all zeros (scale 0), one large
    outlier, and values on a rounding tie (x * (1 / d) = k + 0.5 exactly)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=gen)
    x[0, :32] = 0.0
    if cols >= 64:
        x[-1, 40] = 50.0
    if cols >= 96:
        # amax 127 -> d = 1, id = 1: 2.5 and -3.5 are ties (rounded to even: 2, -4).
        x[0, 64:96] = torch.linspace(-3.5, 2.5, 32)
        x[0, 64] = 127.0
        x[0, 65], x[0, 66] = 2.5, -3.5
    return x


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation_quantization_is_exact(dtype: torch.dtype, restore_isa) -> None:
    """int8 values and fp32 scales equal numpy's, bit for bit, on every ISA (both packed
    layouts: the op checks they agree)."""
    x = activations(5, 1536 + 96, seed=3).to(dtype)
    q_ref, d_ref = gguf_q8.quantize_q8(x.float().numpy())
    assert (q_ref[0, 64:96][[1, 2]] == [2, -4]).all()  # the ties rounded to even
    for isa in ops.supported_isas():
        ops.set_cpu_isa(isa)
        q, d = ops.gguf_quantize_q8(x)
        assert np.array_equal(q.numpy(), q_ref), isa
        assert np.array_equal(d.numpy().view(np.uint32), d_ref.view(np.uint32)), isa


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(64, 96), (37, 576), (13, 544), (9, 1536), (8, 32)])
@pytest.mark.parametrize("tokens", [1, 3, 4, 7])
def test_linear_q8_matches_reference(
    qtype: Q, shape: tuple[int, int], tokens: int, restore_isa
) -> None:
    """y from the kernel against the numpy reference (integer sums exact, scaling in float64).

    Tolerance: the kernel's integer sums are exact (a dword lane sums at most 64 products of
    |q| <= 255 x 128, < 2^24, so its int -> float conversion is exact too); each partial is
    then rounded at most twice (times dx, times dw in an FMA; Q4_1's mw * sx likewise) and
    the partials of a row are summed in fp32 in another order than the reference's: by the
    standard bound at most (blocks + 8) * u * sum |partials| with u = 2^-24, twice that
    allowed. |partials| is taken over the magnitudes the kernel adds (its unsigned weights and
    the -8 / -128 correction terms). One activation rounded differently or one wrong scale,
    nibble or block moves the result by a whole term, far beyond it."""
    rows, cols = shape
    raw = gguf_q8.random_blocks(qtype, rows, cols, seed=rows + tokens)
    weight = gguf_quant.repack_gguf_rows(torch.from_numpy(raw), int(qtype))
    x = activations(tokens, cols, seed=tokens)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ref, magnitude = gguf_q8.linear_q8(xd.float().numpy(), raw, qtype)
        bound = 2 * (cols // 32 + 8) * 2.0**-24 * magnitude
        if dtype == torch.bfloat16:
            bound = bound + 2.0**-8 * np.abs(ref)  # the result rounded to bf16 once
        for isa in ops.supported_isas():
            ops.set_cpu_isa(isa)
            got = ops.gguf_linear_q8(xd, weight, int(qtype))
            assert got.dtype == dtype and got.shape == (tokens, rows)
            err = np.abs(got.double().numpy() - ref)
            assert (err <= bound).all(), (isa, dtype, err.max(), (err / bound).max())


@needs_kernels
def test_linear_q8_strided_and_bad_input() -> None:
    """A row-strided x (a view) gives the contiguous copy's result; bad input is refused."""
    raw = gguf_q8.random_blocks(Q.Q4_1, 16, 64, seed=1)
    weight = gguf_quant.repack_gguf_rows(torch.from_numpy(raw), int(Q.Q4_1))
    wide = torch.randn(3, 96)
    got = ops.gguf_linear_q8(wide[:, :64], weight, int(Q.Q4_1))
    assert torch.equal(got, ops.gguf_linear_q8(wide[:, :64].contiguous(), weight, int(Q.Q4_1)))
    with pytest.raises(RuntimeError, match="not supported"):
        ops.gguf_linear_q8(wide[:, :64], weight, int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.gguf_linear_q8(torch.randn(2, 40), weight, int(Q.Q4_1))
    with pytest.raises(RuntimeError, match="bytes, expected"):
        ops.gguf_linear_q8(torch.randn(2, 96), weight, int(Q.Q4_1))


@needs_kernels
def test_activation_option_routes_the_linear(monkeypatch) -> None:
    """VLLM_PP_GGUF_ACTIVATIONS=int8 sends a GGUF linear below dense_min_tokens to the int8
    kernel (many tokens keep dequantize + GEMM); 'float' (the default) to the float kernel;
    any other value is a ValueError naming the variable."""
    cols = 64
    raw = gguf_q8.random_blocks(Q.Q4_1, 24, cols, seed=5)
    blocks = gguf_quant.repack_gguf_rows(torch.from_numpy(raw), int(Q.Q4_1))
    x = torch.randn(2, cols)
    monkeypatch.setenv("VLLM_PP_GGUF_ACTIVATIONS", "int8")
    weight = gguf_quant.GGUFWeight([(int(Q.Q4_1), blocks)], cols, torch.float32)
    assert torch.equal(weight(x, None), ops.gguf_linear_q8(x, blocks, int(Q.Q4_1)))
    many = torch.randn(gguf_quant.DENSE_MIN_TOKENS, cols)
    dense = ops.gguf_dequantize(blocks, int(Q.Q4_1), cols, torch.float32)
    assert torch.equal(weight(many, None), torch.nn.functional.linear(many, dense))
    monkeypatch.setenv("VLLM_PP_GGUF_ACTIVATIONS", "float")
    weight = gguf_quant.GGUFWeight([(int(Q.Q4_1), blocks)], cols, torch.float32)
    assert torch.equal(weight(x, None), ops.gguf_linear(x, blocks, int(Q.Q4_1)))
    monkeypatch.setenv("VLLM_PP_GGUF_ACTIVATIONS", "fp8")
    with pytest.raises(ValueError, match="VLLM_PP_GGUF_ACTIVATIONS"):
        gguf_quant.GGUFWeight([(int(Q.Q4_1), blocks)], cols, torch.float32)
