"""The sampler's C++ kernel (csrc/sampler.cpp) against torch and a float64 reference: argmax
(first maximum on ties), logsumexp, and inverse-CDF draws, for every instruction-set variant,
vocabulary sizes around the kernel's block widths, and rows with -inf (filtered) tokens."""

from __future__ import annotations

import pytest
import torch

from tests.utils.kernel_env import set_kernels
from vllm import _custom_ops as ops
from vllm.model_executor.layers.sampler import _inverse_cdf_draws

pytestmark = pytest.mark.skipif(not ops._LOADED, reason="vllm._C is not built")

# 1 token, tails shorter than one vector, exact multiples of the 16/32/64-float blocks, and
# SmolLM2's vocabulary.
VOCABS = [1, 5, 16, 63, 64, 65, 1000, 49152]


@pytest.fixture(autouse=True)
def _kernels_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kernels(monkeypatch, True)


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    # Filtered tokens (top-k/top-p leave -inf) in every row but the first.
    mask = torch.rand(rows, vocab, generator=g) < 0.3
    mask[0] = False
    mask[torch.arange(rows), torch.randint(vocab, (rows,), generator=g)] = False
    return x.masked_fill(mask, float("-inf"))


def _reference_draw(row: torch.Tensor, u: float) -> tuple[int, float]:
    """First token whose float64 CDF reaches u; and the distance of u to the nearest CDF step
    (draws that close to a boundary may land on either side in fp32)."""
    p = torch.softmax(row.double(), dim=0)
    cdf = p.cumsum(0)
    token = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64)))
    token = min(token, row.numel() - 1)
    return token, float((cdf - u).abs().min())


@pytest.mark.parametrize("vocab", VOCABS)
def test_argmax_and_lse_match_torch(vocab: int, isa: str) -> None:
    x = _logits(9, vocab, seed=vocab)
    if vocab > 3:
        x[3, 1] = x[3, 2] = x[3].max() + 1  # a tie: torch takes the first
    _, argmax, lse = ops.sample_from_logits(x, torch.zeros(0, dtype=torch.long), torch.zeros(0))
    assert argmax.tolist() == x.argmax(dim=-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("vocab", VOCABS)
def test_draws_match_float64_inverse_cdf(vocab: int, isa: str) -> None:
    x = _logits(6, vocab, seed=100 + vocab)
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randint(6, (200,), generator=g)
    u = 1.0 - torch.rand(200, generator=g)
    tokens, _, _ = ops.sample_from_logits(x, rows, u)
    checked = 0
    for row, ui, token in zip(rows.tolist(), u.tolist(), tokens.tolist()):
        assert x[row, token] > float("-inf"), "a filtered token was drawn"
        expected, margin = _reference_draw(x[row], ui)
        if margin > 1e-5:  # clear of a CDF step: fp32 must agree with float64
            assert token == expected, (row, ui)
            checked += 1
    assert checked > 150


def test_extreme_uniforms_pick_first_and_last_possible_tokens(isa: str) -> None:
    x = torch.full((1, 200), float("-inf"))
    x[0, [7, 50, 130]] = torch.tensor([0.0, 1.0, 2.0])
    rows = torch.zeros(2, dtype=torch.long)
    tokens, argmax, lse = ops.sample_from_logits(x, rows, torch.tensor([1e-30, 1.0]))
    assert tokens.tolist() == [7, 130]
    assert argmax.tolist() == [130]
    assert float(lse) == pytest.approx(float(torch.logsumexp(x[0], 0)), rel=1e-6)


def test_draw_frequencies_follow_the_distribution(isa: str) -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.125])
    x = probs.log().unsqueeze(0).expand(1, 5).contiguous()
    n = 40000
    tokens, _, _ = ops.sample_from_logits(x, torch.zeros(n, dtype=torch.long), 1.0 - torch.rand(n))
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert freq[3] == 0
    # 5 sigma of a binomial at n = 40000 is < 0.0125.
    assert (freq - probs.double()).abs().max() < 0.0125


def test_torch_fallback_draws_follow_the_same_distribution() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.125])
    x = probs.log().unsqueeze(0)
    tokens = torch.tensor(_inverse_cdf_draws(x, [0] * 40000))
    freq = torch.bincount(tokens, minlength=5).double() / 40000
    assert freq[3] == 0 and (freq - probs.double()).abs().max() < 0.0125


def test_all_filtered_row_falls_back_to_argmax() -> None:
    x = torch.full((2, 40), float("-inf"))
    x[1, 5] = 0.0
    tokens, argmax, lse = ops.sample_from_logits(x, torch.tensor([0, 1]), torch.tensor([0.5, 0.5]))
    assert tokens.tolist() == [0, 5] and argmax.tolist() == [0, 5]
    assert lse[0] == float("-inf") and lse[1] == 0.0


def test_strided_logits_rows() -> None:
    base = _logits(4, 130, seed=3)
    x = base[:, :100]  # row stride 130, unit column stride
    tokens, argmax, lse = ops.sample_from_logits(x, torch.tensor([1]), torch.tensor([0.3]))
    assert argmax.tolist() == x.argmax(-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(x, -1))
    assert tokens.item() == _reference_draw(x[1], 0.3)[0]


@pytest.mark.parametrize(
    "rows, uniforms, message",
    [
        ([2], [0.5], "draw_rows\\[0\\] = 2 outside"),
        ([0], [0.0], "uniforms\\[0\\] = 0 outside"),
        ([0], [1.5], "uniforms\\[0\\] = 1.5 outside"),
    ],
)
def test_bad_arguments_are_rejected(rows: list[int], uniforms: list[float], message: str) -> None:
    x = torch.zeros(2, 10)
    with pytest.raises(RuntimeError, match=message):
        ops.sample_from_logits(x, torch.tensor(rows), torch.tensor(uniforms))


def test_threads_give_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _logits(37, 3000, seed=9)
    rows = torch.arange(37).repeat(3)
    u = 1.0 - torch.rand(rows.numel(), generator=torch.Generator().manual_seed(1))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.sample_from_logits(x, rows, u)
        torch.set_num_threads(2)
        two = ops.sample_from_logits(x, rows, u)
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
