"""Float32 matmuls on column panels (csrc/linear_panels.cpp, packed_weight.py): the kernel
against float64 at every row count of its register blocks, each instruction-set variant and
thread split; the layout choice and its variable; and greedy decoding equal to HF with either
packed layout forced."""

from __future__ import annotations

import pytest
import torch

from tests.utils import tiny_models
from vllm import LLM, SamplingParams
from vllm import _custom_ops as ops
from vllm.model_executor.layers import packed_weight
from vllm.model_executor.layers.packed_weight import PackedWeight, choose_layout

pytestmark = pytest.mark.skipif(not ops.is_available(), reason="C++ kernels not built")

CPU = torch.device("cpu")


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("shape", [(37, 100), (576, 960), (1536, 576)])
def test_panels_match_float64(shape: tuple[int, int], isa: str) -> None:
    """Row counts around the 3- and 6-row blocks, a last panel with 4 real columns (100 =
    6 x 16 + 4), with and without bias; each variant within fp32 rounding of float64."""
    k, n = shape
    gen = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = PackedWeight(w, "panels")
    assert packed.data.shape == (-(-n // 16), k, 16)
    for rows in (1, 2, 3, 5, 6, 7, 12, 13, 33):
        x = torch.randn(rows, k, generator=gen)
        for b in (None, bias):
            got = packed(x, b)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            err = (got.double() - _reference(x, w, b)).abs().max().item()
            assert err < 2e-5 * k, (rows, b is None, err)


def test_panels_thread_split_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads split the panels (never a sum): 1 and 2 threads give the same bits."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(49152 // 8, 576, generator=gen), torch.randn(16, 576, generator=gen)
    packed = PackedWeight(w, "panels")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed(x)
        torch.set_num_threads(2)
        two = packed(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_panels_agree_with_onednn_and_reject_bad_input() -> None:
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(200, 64, generator=gen), torch.randn(9, 64, generator=gen)
    panels, onednn = PackedWeight(w, "panels"), PackedWeight(w, "onednn")
    torch.testing.assert_close(panels(x), onednn(x), rtol=0, atol=1e-4)
    torch.testing.assert_close(panels(x.t().contiguous().t()), panels(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="x has 63 columns, the panels 64"):
        panels(torch.randn(2, 63))
    with pytest.raises(TypeError, match="panels hold float32 weights"):
        PackedWeight(w.bfloat16(), "panels")
    with pytest.raises(ValueError, match="unknown layout 'mkl'"):
        PackedWeight(w, "mkl")


def test_layout_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: panels for float32 where the kernels run AVX2, oneDNN (or plain) elsewhere; the
    variable overrides it, bf16 never takes panels, and a bad value names the variable."""
    monkeypatch.setenv("VLLM_CPU_LINEAR_LAYOUT", "auto")
    layout, why = choose_layout(CPU, torch.float32)
    assert layout == ("panels" if ops.cpu_isa() == "avx2" else "onednn"), why
    monkeypatch.setenv("VLLM_CPU_LINEAR_LAYOUT", "onednn")
    assert choose_layout(CPU, torch.float32)[0] == "onednn"
    monkeypatch.setenv("VLLM_CPU_LINEAR_LAYOUT", "panels")
    assert choose_layout(CPU, torch.float32) == (
        "panels",
        f"panel matmuls (torch.float32, {ops.cpu_isa()} kernel)",
    )
    assert choose_layout(CPU, torch.bfloat16)[0] != "panels"
    monkeypatch.setitem(packed_weight._PACK_PROBES, torch.bfloat16, "no bf16 here")
    assert choose_layout(CPU, torch.bfloat16) == (
        None,
        "plain matmul (oneDNN cannot prepack torch.bfloat16 on this CPU: no bf16 here)",
    )
    monkeypatch.setenv("VLLM_CPU_LINEAR_LAYOUT", "mkl")
    with pytest.raises(ValueError, match="VLLM_CPU_LINEAR_LAYOUT must be 'auto', 'panels'"):
        choose_layout(CPU, torch.float32)


@pytest.mark.parametrize("layout", ["panels", "onednn"])
def test_greedy_equals_hf_with_each_layout(
    layout: str, tiny_model_dirs, hf_reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine loads with the forced layout (its report says so) and decodes HF's greedy
    tokens: prefill (many rows) and decode (1-8 rows) both go through the packed weights."""
    kind = "llama-gqa-untied"
    monkeypatch.setenv("VLLM_CPU_LINEAR_LAYOUT", layout)
    llm = LLM(tiny_model_dirs[kind], kv_cache_space=0.05, swap_space=0.01)
    try:
        outs = llm.generate(
            tiny_models.PROMPTS, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False
        )
        path = llm.llm_engine.executor.worker.model_runner.model.linear_path
    finally:
        llm.shutdown()
    assert path.startswith("panel matmuls" if layout == "panels" else "oneDNN prepacked"), path
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_reference(kind)
