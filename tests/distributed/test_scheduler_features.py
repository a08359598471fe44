"""Chunked prefill and prefix caching end to end on a tiny model: greedy tokens and prompt
logprobs equal HF's for prompts longer than the chunk (PP = 1 and 2), prefix hits (also after
eviction) change nothing; and a watchdog: for random small caches, block sizes, beam widths and
`n`, every request ends."""

from __future__ import annotations

import random

import pytest
import torch

from tests.utils import tiny_models
from vllm import LLM, EngineArgs, LLMEngine, SamplingParams

KIND = "llama-gqa-untied"
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


_rng = random.Random(1234)
# Longer than every chunk tried (up to 490 of the tiny models' 512 positions).
LONG_PROMPTS = [_random_ids(_rng, n) for n in (7, 61, 200, 490)]
# Prefixes of 1..8 blocks of 16 tokens of one "system prompt", each with its own question.
SYSTEM = _random_ids(_rng, 8 * 16)
SHARED_PROMPTS = [SYSTEM[: 16 * k] + _random_ids(_rng, 3 + k) for k in range(1, 9)]
OTHER_PROMPTS = [_random_ids(_rng, 150) for _ in range(3)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dirs):
    return tiny_models.load_hf(tiny_model_dirs[KIND])


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    return tiny_models.hf_greedy_ids(model, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def hf_long(hf_model):
    """Greedy continuations and per-position log-softmax of the long prompts."""
    with torch.inference_mode():
        logprobs = [hf_model(torch.tensor([ids])).logits[0].log_softmax(-1) for ids in LONG_PROMPTS]
    return _hf_greedy(hf_model, LONG_PROMPTS), logprobs


@pytest.fixture(scope="module")
def hf_shared(hf_model):
    return _hf_greedy(hf_model, SHARED_PROMPTS + OTHER_PROMPTS)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _check_prompt_logprobs(outputs, reference) -> None:
    for out, ref, ids in zip(outputs, reference, LONG_PROMPTS):
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            entry = plp[i]
            assert abs(entry[ids[i]].logprob - float(ref[i - 1, ids[i]])) < 1e-3
            top = int(ref[i - 1].argmax())
            assert top in entry and entry[top].rank == 1


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_chunked_prefill_matches_hf(chunk, tiny_model_dirs, hf_long):
    greedy, logprobs = hf_long
    llm = LLM(
        tiny_model_dirs[KIND],
        enable_chunked_prefill=True,
        max_num_batched_tokens=chunk,
        max_num_seqs=chunk,
        kv_cache_space=0.05,
        swap_space=0.01,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if chunk == 32:
        params.prompt_logprobs = 2
    outputs = _generate(llm, LONG_PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == greedy
    if chunk == 32:
        _check_prompt_logprobs(outputs, logprobs)
        assert outputs[2].prompt_logprobs[1][LONG_PROMPTS[2][1]].decoded_token is not None
    llm.shutdown()


def test_prefix_caching_matches_hf_also_after_eviction(tiny_model_dirs, hf_shared):
    llm = LLM(
        tiny_model_dirs[KIND],
        enable_prefix_caching=True,
        num_gpu_blocks_override=40,
        max_model_len=256,
        swap_space=0.01,
    )
    scheduler = llm.llm_engine.scheduler
    shared_ref = hf_shared[: len(SHARED_PROMPTS)]
    # Warm the cache with the whole system prompt, then every prefix length hits.
    _generate(llm, [SYSTEM + [5, 6, 7]])
    outputs = _generate(llm, SHARED_PROMPTS)
    assert [o.outputs[0].token_ids for o in outputs] == shared_ref
    bm = scheduler.block_manager
    assert bm.num_hit_blocks >= sum(range(1, 9)) - 1
    # Unrelated prompts take (40 - 10) plain blocks and then evict cached ones.
    hits = bm.num_hit_blocks
    outputs = _generate(llm, OTHER_PROMPTS)
    assert [o.outputs[0].token_ids for o in outputs] == hf_shared[len(SHARED_PROMPTS) :]
    assert bm.num_hit_blocks == hits
    outputs = _generate(llm, SHARED_PROMPTS[::-1])
    assert [o.outputs[0].token_ids for o in outputs] == shared_ref[::-1]
    stats = scheduler.get_stats()
    assert 0 < stats["gpu_prefix_cache_hit_rate"] < 1
    assert bm.get_num_free_gpu_blocks() == 40
    llm.shutdown()


@pytest.mark.ray
def test_chunked_prefill_and_prefix_caching_at_pp2(
    ray_session, tiny_model_dirs, hf_long, hf_shared
):
    llm = LLM(
        tiny_model_dirs[KIND],
        pipeline_parallel_size=2,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=32,
        max_num_seqs=16,
        kv_cache_space=0.05,
        swap_space=0.01,
    )
    greedy, logprobs = hf_long
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    params.prompt_logprobs = 1
    outputs = _generate(llm, LONG_PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == greedy
    _check_prompt_logprobs(outputs, logprobs)
    _generate(llm, [SYSTEM + [5, 6, 7]])
    outputs = _generate(llm, SHARED_PROMPTS)
    assert [o.outputs[0].token_ids for o in outputs] == hf_shared[: len(SHARED_PROMPTS)]
    assert llm.llm_engine.scheduler.block_manager.num_hit_blocks > 0
    llm.shutdown()


def test_watchdog_every_request_ends(tiny_model_dirs):
    """Random tiny caches, block sizes, beam widths, n/best_of, preemption modes, chunked
    prefill and prefix caching: every request finishes (some as ignored), none hangs."""
    rng = random.Random(7)
    for trial in range(4):
        block_size = rng.choice([8, 16])
        num_blocks = rng.randint(4, 12)
        chunked = trial % 2 == 1
        args = EngineArgs(
            model=tiny_model_dirs["opt-pre"],
            block_size=block_size,
            num_gpu_blocks_override=num_blocks,
            max_model_len=min(512, num_blocks * block_size),
            swap_space=0.01,
            preemption_mode=rng.choice([None, "swap", "recompute"]),
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=rng.choice([16, 32]) if chunked else None,
            max_num_seqs=8,
            enable_prefix_caching=trial in (0, 3),
        )
        engine = LLMEngine.from_engine_args(args)
        expected = set()
        for i in range(5):
            prompt = (SYSTEM[: rng.randint(1, 40)] if i % 2 else _random_ids(rng, 1))[:]
            prompt += _random_ids(rng, rng.randint(1, 30))
            width = rng.choice([1, 2, 3, 4])
            kind = rng.choice(["beam", "n", "greedy"])
            if kind == "beam" and width > 1:
                params = SamplingParams(
                    n=width,
                    best_of=width,
                    use_beam_search=True,
                    temperature=0.0,
                    max_tokens=rng.randint(4, 24),
                    ignore_eos=True,
                )
            elif kind == "n":
                params = SamplingParams(
                    n=width,
                    best_of=width + rng.randint(0, 1),
                    temperature=1.0,
                    seed=i,
                    max_tokens=rng.randint(4, 24),
                    ignore_eos=True,
                )
            else:
                params = SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 32))
            engine.add_request(f"{trial}-{i}", None, params, prompt_token_ids=prompt)
            expected.add(f"{trial}-{i}")
        finished = set()
        for _ in range(3000):
            if not engine.has_unfinished_requests():
                break
            finished.update(o.request_id for o in engine.step() if o.finished)
        assert not engine.has_unfinished_requests(), f"trial {trial}: requests hang"
        assert finished == expected, f"trial {trial}: {expected - finished} never finished"
        assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == num_blocks
        engine.shutdown()
