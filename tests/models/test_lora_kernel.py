"""The batched LoRA update of a wrapped layer (vllm/lora/layers.py): the C++ kernel
(csrc/lora.cpp) and the pure-torch path, each against a per-token loop in PEFT's order of
operations, `out[t, slice] += ((x[t] @ A^T) @ B^T) * scaling`.

Layers: a fused q/k/v (three slices) and a plain one, with sizes that leave a tail for every
vector width; adapters of ranks below max_rank, one that skips a slice (k), tokens of the base
model between adapted ones, one slot for every token. The kernel runs on each instruction-set
variant the CPU has. float32: within fp32 summation-order tolerance of the loop; bfloat16: the
loop rounds like torch (each materialised tensor in bf16), the kernel sums its dot products in
another order, so a bf16 ulp or two apart. Rows of the base model's tokens and columns of a
slice the adapter does not target are the base layer's output, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.utils.kernel_env import set_kernels
from vllm import _custom_ops as ops
from vllm.lora.layers import LoRAContext, LoRALinear
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

IN = 40  # a tail for 16-, 8- and 4-lane vectors
QKV = (24, 8, 8)  # q, k, v output rows (head size 4: 6 query heads, 2 KV heads)
MAX_RANK = 8
SLOTS = 4
RANKS = [4, 8, 2, 8]  # per slot
SCALING = [0.5, 1.75, 2.0, 0.3]
PATTERNS = {
    "mixed": [0, 1, -1, 2, 3, 3, -1, 1, 0, 2, 2, 1, 3],
    "one-slot": [2] * 9,
    "one-slot-and-base": [-1, 1, 1, -1, 1],
    "decode16": [i % 4 for i in range(16)],
}


@pytest.fixture(autouse=True)
def _kernels_enabled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    set_kernels(monkeypatch, True)
    yield


def make_layer(
    kind: str, dtype: torch.dtype, seed: int = 0
) -> tuple[LoRALinear, LoRAContext, dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]]:
    """A wrapped layer with an adapter in each slot; slot 2 targets q and v only (fused)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "qkv":
        # head_size 4: 6 query heads (24 rows), 2 KV heads (8 rows each for k and v).
        base = QKVParallelLinear(IN, 4, 6, 2, bias=True)
        sizes = list(QKV)
        names: tuple[str, ...] = ("q", "k", "v")
    else:
        base = RowParallelLinear(IN, 36, bias=True)
        sizes, names = [36], ("o",)
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=gen) * 0.1)
        base.bias.copy_(torch.randn(base.bias.shape, generator=gen) * 0.1)
    base.to(dtype)
    context = LoRAContext()
    layer = LoRALinear(base, names, sizes, context, SLOTS, MAX_RANK, dtype, "cpu")
    weights: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for slot, rank in enumerate(RANKS):
        parts = [0, 2] if slot == 2 and len(sizes) == 3 else list(range(len(sizes)))
        weights[slot] = {
            i: (
                (torch.randn(rank, IN, generator=gen) * 0.3).to(dtype),
                (torch.randn(sizes[i], rank, generator=gen) * 0.3).to(dtype),
            )
            for i in parts
        }
        layer.set_slot(slot, weights[slot], SCALING[slot])
    return layer, context, weights


def reference(
    layer: LoRALinear,
    weights: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]],
    x: torch.Tensor,
    slots: list[int],
) -> torch.Tensor:
    """The base output plus each token's update, one token and one slice at a time, rounded
    as PEFT's modules round in x's dtype."""
    expected = layer.base(x)
    for t, slot in enumerate(slots):
        for i, (a, b) in weights.get(slot, {}).items():
            rows = slice(layer.slice_offsets[i], layer.slice_offsets[i] + b.shape[0])
            delta = (x[t : t + 1] @ a.t()) @ b.t()
            expected[t, rows] = expected[t, rows] + (delta * SCALING[slot])[0]
    return expected


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def run(layer: LoRALinear, context: LoRAContext, x: torch.Tensor, slots: list[int]):
    context.set_tokens(torch.tensor(slots))
    try:
        return layer(x)
    finally:
        context.clear()


def strided(x: torch.Tensor) -> torch.Tensor:
    """x as a column slice of a wider buffer (rows strided, unit last stride)."""
    buf = torch.zeros(x.shape[0], x.shape[1] + 8, dtype=x.dtype)
    buf[:, 3 : 3 + x.shape[1]] = x
    return buf[:, 3 : 3 + x.shape[1]]


pytestmark = pytest.mark.skipif(
    not ops._LOADED,
    reason="vllm._C is not built (run `pip install --no-deps --no-build-isolation -e .`)",
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["qkv", "plain"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_kernel_equals_per_token_loop(kind: str, pattern: str, dtype, isa: str) -> None:
    layer, context, weights = make_layer(kind, dtype)
    slots = PATTERNS[pattern]
    x = (torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(1))).to(dtype)
    xs = strided(x)
    context.set_tokens(torch.tensor(slots))
    assert context.use_kernel
    got = layer(xs)
    context.clear()
    expected = reference(layer, weights, x, slots)
    torch.testing.assert_close(got, expected, **tolerance(dtype))
    base = layer.base(xs)  # (the same input layout as the update's base matmul)
    for t, slot in enumerate(slots):
        if slot < 0:  # the base model's tokens: the base output, bit for bit
            assert torch.equal(got[t], base[t])
        elif slot == 2 and kind == "qkv":  # k is not targeted: its columns are untouched
            assert torch.equal(got[t, 24:32], base[t, 24:32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_torch_path_equals_per_token_loop(
    pattern: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_kernels(monkeypatch, False)
    layer, context, weights = make_layer("qkv", dtype)
    slots = PATTERNS[pattern]
    x = (torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(1))).to(dtype)
    context.set_tokens(torch.tensor(slots))
    assert not context.use_kernel
    got = layer(x)
    context.clear()
    torch.testing.assert_close(got, reference(layer, weights, x, slots), **tolerance(dtype))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_fused_module_adapter(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3's checkpoints fuse q/k/v: its adapter is one A and a B over all three slices."""
    if not kernel:
        set_kernels(monkeypatch, False)
    layer, context, weights = make_layer("qkv", torch.float32)
    gen = torch.Generator().manual_seed(3)
    fused = {0: (torch.randn(6, IN, generator=gen), torch.randn(sum(QKV), 6, generator=gen))}
    layer.set_slot(1, fused, SCALING[1])
    weights[1] = fused
    slots = PATTERNS["mixed"]
    x = torch.randn(len(slots), IN, generator=gen)
    expected = reference(layer, weights, x, slots)
    torch.testing.assert_close(run(layer, context, x, slots), expected, **tolerance(x.dtype))
    with pytest.raises(ValueError, match="more than the 16 outputs"):
        layer.set_slot(1, {1: fused[0]}, 1.0)


def test_no_adapter_in_the_step_is_the_base_layer() -> None:
    layer, context, _ = make_layer("qkv", torch.float32)
    x = torch.randn(5, IN)
    context.set_tokens(torch.full((5,), -1))
    assert not context.active
    assert torch.equal(layer(x), layer.base(x))


def test_cleared_slot_adds_nothing() -> None:
    layer, context, _ = make_layer("qkv", torch.float32)
    layer.clear_slot(1)
    x = torch.randn(6, IN)
    assert torch.equal(run(layer, context, x, [1, -1, 1, 1, -1, 1]), layer.base(x))


def test_thread_split_gives_identical_rows() -> None:
    """A prefill-sized batch splits over threads; each token's rows are computed alike
    whatever task holds them."""
    layer, context, _ = make_layer("qkv", torch.float32)
    slots = [i % 5 - 1 for i in range(700)]
    x = torch.randn(len(slots), IN)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(layer, context, x, slots)
        torch.set_num_threads(2)
        two = run(layer, context, x, slots)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_indices_are_refused_before_writing() -> None:
    layer, _, _ = make_layer("plain", torch.float32)
    out = torch.zeros(3, 36)
    x = torch.randn(3, IN)
    tokens = torch.tensor([0, 5])  # token 5 of 3
    slots = torch.tensor([1, 1])
    with pytest.raises(RuntimeError, match=r"tokens\[1\] = 5 out of range"):
        ops.lora_apply(
            out, x, layer.lora_a, layer.lora_b_t, tokens, slots, layer.scale, layer.ranks,
            layer.slice_bounds,
        )  # fmt: skip
    assert not out.any()
    with pytest.raises(RuntimeError, match=r"slots\[0\] = 4 out of range"):
        ops.lora_apply(
            out, x, layer.lora_a, layer.lora_b_t, tokens[:1], torch.tensor([4]), layer.scale,
            layer.ranks, layer.slice_bounds,
        )  # fmt: skip
