"""Greedy output of the engine (single stage) equals HF transformers' exactly, token ids and
text, for every tiny model, every block size, and under forced preemption (recompute, swap)."""

from __future__ import annotations

import pytest

from tests.utils import tiny_models
from vllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def assert_matches_hf(llm: LLM, reference: list[list[int]]) -> None:
    outputs = llm.generate(tiny_models.PROMPTS, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert [o.prompt for o in outputs] == tiny_models.PROMPTS  # input order kept
    for out, ref in zip(outputs, reference):
        completion = out.outputs[0]
        assert completion.token_ids == ref, f"prompt {out.prompt!r}"
        assert completion.text == tokenizer.decode(ref, skip_special_tokens=True)
        assert completion.finish_reason in ("stop", "length")
        assert completion.finish_reason == ("length" if len(ref) == 32 else "stop")


@pytest.mark.parametrize("kind", tiny_models.KINDS)
def test_greedy_matches_hf(kind, tiny_model_dirs, hf_reference):
    llm = LLM(tiny_model_dirs[kind], kv_cache_space=0.05, swap_space=0.01)
    assert_matches_hf(llm, hf_reference(kind))
    llm.shutdown()


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size, tiny_model_dirs, hf_reference):
    kind = "llama-gqa-tied"
    llm = LLM(tiny_model_dirs[kind], block_size=block_size, kv_cache_space=0.05, swap_space=0.01)
    assert_matches_hf(llm, hf_reference(kind))


@pytest.mark.parametrize(
    "kind,mode,block_size",
    [
        ("llama-gqa-untied", "recompute", 16),
        ("llama-gqa-untied", "swap", 16),
        ("opt-post", "recompute", 8),
        ("opt-pre", "swap", 32),
    ],
)
def test_preemption_keeps_outputs(kind, mode, block_size, tiny_model_dirs, hf_reference):
    # 8 prompts of up to ~40 tokens + 32 new ones need ~40 blocks of 16; give far fewer.
    num_blocks = {8: 24, 16: 12, 32: 6}[block_size]
    llm = LLM(
        tiny_model_dirs[kind],
        block_size=block_size,
        num_gpu_blocks_override=num_blocks,
        max_model_len=num_blocks * block_size,
        swap_space=0.01,
        preemption_mode=mode,
    )
    assert_matches_hf(llm, hf_reference(kind))
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_cumulative_preemption > 0, "the cache was meant to force preemption"
    # Everything is given back at the end.
    assert scheduler.block_manager.get_num_free_gpu_blocks() == num_blocks


def test_prompt_token_ids_and_per_prompt_params(tiny_model_dirs, hf_reference):
    kind = "opt-pre"
    llm = LLM(tiny_model_dirs[kind], kv_cache_space=0.05, swap_space=0.01)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(p) for p in tiny_models.PROMPTS[:3]]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 8, 32)]
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    ref = hf_reference(kind)
    for out, n, r, i in zip(outputs, (4, 8, 32), ref, ids):
        assert out.prompt_token_ids == i
        assert out.outputs[0].token_ids == r[:n]
    single = llm.generate(tiny_models.PROMPTS[1], GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == ref[1]


def test_positions_past_the_config_context_with_vllms_variable(tiny_model_dirs, monkeypatch):
    """With VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and max_model_len past max_position_embeddings
    (512 here), a prompt reaching past it runs (rope rows for every position up to
    max_model_len) and its greedy tokens equal HF's, whose default rope has no table."""
    import random

    kind = "llama-gqa-untied"
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    rng = random.Random(640)
    prompt = [rng.randrange(100, 1000) for _ in range(600)]
    llm = LLM(tiny_model_dirs[kind], max_model_len=640, kv_cache_space=0.05, swap_space=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    llm.shutdown()
    model = tiny_models.load_hf(tiny_model_dirs[kind])
    assert list(out.outputs[0].token_ids) == tiny_models.hf_greedy_ids(model, [prompt], 12)[0]
