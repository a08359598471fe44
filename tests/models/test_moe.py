"""Mixture of experts: the grouped-expert block equals HF's Mixtral and Qwen3-MoE blocks on the
same weights and computes only the routed rows; its TP shards sum to the whole; Mixtral
checkpoints load per-expert or stacked, per stage and TP rank; a tiny random Mixtral's greedy
ids and text equal HF's at PP 1/2/3, TP 2 and TP 2 x PP 2 on mp and Ray, also with chunked
prefill and prefix caching on."""

from __future__ import annotations

import os

import pytest
import torch

from tests.utils import tiny_models, tiny_moe
from tests.utils.kernel_env import set_kernels
from tests.utils.tiny_moe import EXPERTS, INTER, LAYERS, TOP_K, H
from vllm import LLM, SamplingParams
from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.layers import fused_moe
from vllm.model_executor.layers.fused_moe import (
    SparseMoeBlock,
    dense_experts,
    grouped_experts,
    per_token_experts,
    topk_route,
)
from vllm.model_executor.models.utils import StageLayout

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """kind -> a tiny random checkpoint (tests/utils/tiny_moe.py): "mixtral" (4 layers, 4
    experts, top-2) and "qwen3_moe" (4 layers, 8 experts, top-2, head_dim 32 != hidden /
    heads, layer 2 dense)."""
    return tiny_moe.moe_dirs(str(tmp_path_factory.mktemp("moe")))


@pytest.fixture(scope="module")
def mixtral_dir(model_dirs) -> str:
    return model_dirs["mixtral"]


@pytest.fixture(scope="module")
def hf_ids(model_dirs):
    """kind -> HF greedy ids of tiny_models.PROMPTS (32 new tokens), computed once."""
    cache: dict[str, list[list[int]]] = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            cache[kind] = tiny_models.hf_greedy(model_dirs[kind], tiny_models.PROMPTS, 32)
        return cache[kind]

    return get


# --- the block against HF's ------------------------------------------------------------------


def _hf_block(kind: str, dtype: torch.dtype, norm_topk_prob: bool = False):
    """HF's sparse MoE block (eager experts) with random weights, and ours holding them."""
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = tiny_moe.mixtral_config()
        config._experts_implementation = "eager"
        hf = MixtralSparseMoeBlock(config)
        ours = SparseMoeBlock(H, INTER, EXPERTS, TOP_K, renormalize=True)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(
            hidden_size=H,
            moe_intermediate_size=INTER,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=norm_topk_prob,
        )
        config._experts_implementation = "eager"
        hf = Qwen3MoeSparseMoeBlock(config)
        ours = SparseMoeBlock(
            H, INTER, 8, 3, renormalize=norm_topk_prob, weights_in_input_dtype=True
        )
    tiny_moe.randomise(hf, seed=1)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.w13_weight.copy_(hf.experts.gate_up_proj)
        ours.experts.w2_weight.copy_(hf.experts.down_proj)
    return hf.eval().to(dtype), ours.eval().to(dtype)


@pytest.mark.parametrize(
    "kind,norm", [("mixtral", True), ("qwen3_moe", False), ("qwen3_moe", True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_equals_hf(kind, norm, dtype, monkeypatch):
    hf, ours = _hf_block(kind, dtype, norm_topk_prob=norm)
    x = torch.randn(53, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        expected = hf(x[None])[0]
        # The C++ SiLU-and-mul kernel may differ from torch's by an ulp; the torch path is
        # HF's own arithmetic, in HF's order: bit-equal.
        set_kernels(monkeypatch, False)
        assert torch.equal(ours(x), expected)
        set_kernels(monkeypatch, True)
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=tol)


def test_routing_normalisation():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    weights, ids = topk_route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])
    weights, _ = topk_route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, probs[:, :2] / probs[:, :2].sum())
    assert weights.dtype == torch.float32


def _random_problem(tokens: int, dtype=torch.float32, experts: int = 8, top_k: int = 2):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    w13 = (0.1 * torch.randn(experts, 2 * INTER, H, generator=gen)).to(dtype)
    w2 = (0.1 * torch.randn(experts, H, INTER, generator=gen)).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = topk_route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_computes_only_routed_rows(tokens, monkeypatch):
    """One gate/up and one down matmul per expert that got tokens, T * top_k rows in all (not
    every expert on every token); equal to the per-token and dense references."""
    x, w13, w2, weights, ids = _random_problem(tokens)
    calls: list[int] = []
    real = fused_moe.F.linear

    def counting(inp, weight, *args):
        calls.append(inp.shape[0])
        return real(inp, weight, *args)

    monkeypatch.setattr(fused_moe.F, "linear", counting)
    out = grouped_experts(x, w13, w2, weights, ids)
    used = len(set(ids.flatten().tolist()))
    assert len(calls) == 2 * used and sum(calls) == 2 * tokens * TOP_K
    monkeypatch.setattr(fused_moe.F, "linear", real)
    torch.testing.assert_close(per_token_experts(x, w13, w2, weights, ids), out)
    torch.testing.assert_close(dense_experts(x, w13, w2, weights, ids), out)


def test_tp_shards_sum_to_whole(monkeypatch):
    """Each expert split like an MLP over 2 ranks (gate/up rows, down columns, as the loader
    cuts them): the ranks' partial outputs sum to the unsharded block's."""
    x, w13, w2, weights, ids = _random_problem(33)
    whole = grouped_experts(x, w13, w2, weights, ids)
    total = torch.zeros_like(whole)
    for rank in range(2):
        monkeypatch.setattr(tpu, "tp_size", lambda: 2)
        monkeypatch.setattr(tpu, "tp_rank", lambda rank=rank: rank)
        experts = fused_moe.FusedMoE(8, H, INTER, reduce_results=False)
        for e in range(8):
            gate, up = w13[e].chunk(2)
            for part, full in (("gate", gate), ("up", up), ("down", w2[e])):
                name = f"model.layers.0.mlp.experts.{e}.{part}_proj.weight"
                shard = fused_moe.moe_weight_shard(name, INTER)
                experts.load_weight(shard.narrow(full), part, e, name)
        total += experts(x, weights, ids)
    torch.testing.assert_close(total, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_experts_equal_unpacked(dtype):
    """pack_linears prepacks the experts (the engine's CPU path), dropping the stacked
    parameters; the outputs stay those of the unpacked matmuls (to rounding)."""
    from vllm.model_executor.layers.linear import linear_path, pack_linears

    # The engine prepacks only where oneDNN can (bf16 needs AVX-512 BW/VL/DQ or
    # AVX-NE-CONVERT); elsewhere it runs the plain matmuls this test compares against.
    packs, path = linear_path(torch.device("cpu"), dtype)
    if not packs:
        pytest.skip(f"the engine does not prepack {dtype} on this CPU: {path}")

    x, w13, w2, weights, ids = _random_problem(40, dtype)
    block = SparseMoeBlock(H, INTER, 8, TOP_K, renormalize=True).to(dtype)
    with torch.no_grad():
        block.experts.w13_weight.copy_(w13)
        block.experts.w2_weight.copy_(w2)
    expected = block(x)
    assert pack_linears(block) == 2  # the router and the experts
    assert not list(block.experts.parameters())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(block(x), expected, rtol=0, atol=tol)


def test_bad_moe_config_is_refused(model_dirs):
    from transformers import AutoConfig

    from vllm.config import ModelConfig, ParallelConfig, PlainConfig

    path = model_dirs["qwen3_moe"]
    config = ModelConfig(path, hf_config=PlainConfig.from_hf(AutoConfig.from_pretrained(path)))
    config.hf_config.moe_intermediate_size = 90  # not a multiple of 4 ranks
    with pytest.raises(ValueError, match=r"MoE experts' intermediate size \(90\)"):
        config.verify_with_parallel_config(ParallelConfig(1, 4))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoeBlock(H, INTER, 4, 5, renormalize=True)
    with pytest.raises(ValueError, match="hidden_act"):
        SparseMoeBlock(H, INTER, 4, 2, renormalize=True, hidden_act="gelu")


# --- loading ---------------------------------------------------------------------------------


def _load_stage(path: str, layout: StageLayout, tp: int, rank: int, monkeypatch):
    """Build and load one stage of the checkpoint at `path` as TP rank `rank` of `tp`, in
    this process (only the shard arithmetic is faked)."""
    from transformers import AutoConfig

    from vllm.model_executor.models.mixtral import MixtralForCausalLM
    from vllm.model_executor.weight_utils import iter_safetensors

    monkeypatch.setattr(tpu, "tp_size", lambda: tp)
    monkeypatch.setattr(tpu, "tp_rank", lambda: rank)
    model = MixtralForCausalLM(AutoConfig.from_pretrained(path), layout)
    model.load_weights(iter_safetensors(path, model.owns_weight, model.weight_shard))
    return model


def test_stacked_checkpoint_loads_like_per_expert(mixtral_dir, tmp_path, monkeypatch):
    """transformers' in-memory names (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
    [E, H, I]) load to the same parameters as the per-expert names it saves, for each
    stage of PP=2 and each TP rank."""
    import shutil

    from safetensors.torch import save_file

    hf = tiny_models.load_hf(mixtral_dir)
    stacked = str(tmp_path / "stacked")
    os.makedirs(stacked)
    shutil.copy(os.path.join(mixtral_dir, "config.json"), stacked)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, f"{stacked}/m.safetensors")
    assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())
    for layout in (StageLayout(0, 2, True, False), StageLayout(2, 4, False, True)):
        for rank in range(2):
            a = _load_stage(mixtral_dir, layout, 2, rank, monkeypatch).state_dict()
            b = _load_stage(stacked, layout, 2, rank, monkeypatch).state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            w13 = a["model.layers.0.mlp.experts.w13_weight"]
            assert w13.shape == (EXPERTS, INTER, H)  # 2 * INTER / 2 ranks
            hf_w13 = hf.model.layers[layout.start_layer].mlp.experts.gate_up_proj
            half = INTER // 2
            assert torch.equal(w13[:, :half], hf_w13[:, rank * half : (rank + 1) * half])
            assert torch.equal(w13[:, half:], hf_w13[:, INTER + rank * half :][:, :half])


def test_missing_expert_is_named(mixtral_dir, tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "broken")
    os.makedirs(path)
    shutil.copy(os.path.join(mixtral_dir, "config.json"), path)
    tensors = load_file(os.path.join(mixtral_dir, "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="expert 2's up projection of layer 1"):
        _load_stage(path, StageLayout(0, LAYERS, True, True), 1, 0, monkeypatch)


def test_moe_layer_cost_in_auto_partition(model_dirs):
    """`--pp-layer-partition auto` weighs an MoE layer by its top_k experts and router, not as
    one dense MLP: the lm_head counts for fewer layers than if the model were dense."""
    from transformers import AutoConfig

    from vllm.config import ModelConfig, PlainConfig

    # (attention q and kv widths, number of experts, one expert's intermediate size)
    for kind, q, kv, experts, inter in [
        ("mixtral", 4 * 16, 2 * 16, EXPERTS, INTER),
        ("qwen3_moe", 4 * 32, 2 * 32, 8, INTER),  # moe_intermediate_size, not the dense 128
    ]:
        config = ModelConfig(model_dirs[kind])
        vocab = config.get_vocab_size()
        attn = (q + 2 * kv) * H + H * q
        moe = TOP_K * (2 * inter * H + H * inter) + experts * H
        assert config.get_lm_head_cost_in_layers() == pytest.approx(vocab * H / (attn + moe))
        fields = PlainConfig.from_hf(AutoConfig.from_pretrained(model_dirs[kind])).__dict__
        del fields["num_experts_per_tok"]
        dense = ModelConfig(model_dirs[kind], hf_config=PlainConfig(fields))
        assert dense.get_lm_head_cost_in_layers() > config.get_lm_head_cost_in_layers()


# --- end to end: HF-equal at every layout ----------------------------------------------------


def _check(llm: LLM, expected: list[list[int]]) -> None:
    outs = llm.generate(tiny_models.PROMPTS, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref, f"prompt {out.prompt!r}"
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


FEATURES = dict(
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
    max_num_batched_tokens=16,  # the longer prompts prefill in 2-3 chunks
    max_num_seqs=16,
)


def _run_layout(path: str, expected, tp: int, pp: int, backend: str, features: bool) -> None:
    llm = LLM(
        path,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        kv_cache_space=0.05,
        swap_space=0.01,
        **(FEATURES if features else {}),
    )
    try:
        infos = llm.llm_engine.get_stage_infos() if tp * pp > 1 else []
        sizes = sorted({i.layers for i in infos if i.layers})
        if pp == 3:
            assert sizes == [(0, 2), (2, 3), (3, 4)]  # uneven: 2/1/1
        _check(llm, expected)
        if features:
            # Again: every prompt's full blocks now come from the prefix cache.
            blocks = llm.llm_engine.scheduler.block_manager
            hits = blocks.num_hit_blocks
            _check(llm, expected)
            assert blocks.num_hit_blocks > hits
        if tp == 2 and pp == 2:
            # Each of the 4 ranks holds about a quarter of the weights (experts included).
            total = sum(i.num_params for i in infos)
            assert all(abs(i.num_params * 4 / total - 1) < 0.05 for i in infos), infos
    finally:
        llm.shutdown()


@pytest.mark.parametrize("features", [False, True])
def test_mixtral_single_process_matches_hf(features, mixtral_dir, hf_ids):
    _run_layout(mixtral_dir, hf_ids("mixtral"), 1, 1, "uni", features)


LAYOUTS = [(1, 2), (1, 3), (2, 1), (2, 2)]  # (tp, pp)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_mixtral_mp_matches_hf_with_chunked_prefill_and_prefix_caching(tp, pp, mixtral_dir, hf_ids):
    _run_layout(mixtral_dir, hf_ids("mixtral"), tp, pp, "mp", features=True)


@pytest.mark.ray
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_mixtral_ray_matches_hf(tp, pp, mixtral_dir, hf_ids, ray_session):
    _run_layout(mixtral_dir, hf_ids("mixtral"), tp, pp, "ray", features=False)


@pytest.mark.parametrize(
    "tp,pp,backend,features",
    [
        (1, 1, "uni", True),
        (1, 3, "mp", True),  # the dense layer 2 alone on stage 1
        (2, 2, "mp", False),
        pytest.param(2, 2, "ray", True, marks=pytest.mark.ray),
        # The rest of the layouts, each on one backend.
        (1, 2, "mp", True),
        pytest.param(2, 1, "ray", False, marks=pytest.mark.ray),
    ],
)
def test_qwen3_moe_matches_hf(tp, pp, backend, features, model_dirs, hf_ids, request):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    _run_layout(model_dirs["qwen3_moe"], hf_ids("qwen3_moe"), tp, pp, backend, features)
