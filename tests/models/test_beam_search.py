"""Beam search equals HF `generate(num_beams=k, do_sample=False)`: the same returned beams in
the same order, for several length penalties and early_stopping modes, with hypotheses
finishing at different lengths; also under swap preemption. Invalid combinations raise
vLLM's errors."""

from __future__ import annotations

import pytest
import torch

from tests.utils import tiny_models
from vllm import LLM, SamplingParams

MAX = 10
# (beam width, n, length_penalty, early_stopping, also stop on the real EOS)
CASES = [
    (4, 4, 1.0, False, False),
    (3, 2, 0.5, True, True),
    (4, 3, 2.0, "never", False),
    (2, 2, -1.0, False, True),
    (3, 3, 0.0, "never", True),
]


@pytest.fixture(scope="module", params=["llama-gqa-untied", "opt-post"])
def setup(request, tiny_model_dirs):
    path = tiny_model_dirs[request.param]
    llm = LLM(path, kv_cache_space=0.05, swap_space=0.02)
    hf = tiny_models.load_hf(path)
    yield llm, hf
    llm.shutdown()


def hf_beams(hf, ids, width, n, lp, es, eos_ids) -> list[list[int]]:
    """HF's returned beams (best first), each cut after its EOS (padding is eos_ids[0])."""
    with tiny_models.one_thread_if_tiny(hf), torch.no_grad():
        t = torch.tensor([ids])
        out = hf.generate(
            t,
            attention_mask=torch.ones_like(t),
            do_sample=False,
            num_beams=width,
            num_return_sequences=n,
            length_penalty=lp,
            early_stopping=es,
            max_new_tokens=MAX,
            eos_token_id=eos_ids,
            pad_token_id=eos_ids[0],
        )
    beams = []
    for row in out[:, len(ids) :].tolist():
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        beams.append(row if end is None else row[: end + 1])
    return beams


def test_beam_search_matches_hf(setup):
    llm, hf = setup
    tok = llm.get_tokenizer()
    prompts = tiny_models.PROMPTS[:4]
    # A token the plain beams produce early: used as an extra EOS so that hypotheses end at
    # different lengths (random tiny models almost never emit the real EOS).
    plain = llm.generate(
        prompts,
        SamplingParams(n=4, use_beam_search=True, temperature=0, max_tokens=MAX),
        use_tqdm=False,
    )
    finished_early = 0
    for width, n, lp, es, real_eos in CASES:
        for prompt, base in zip(prompts, plain):
            stop = base.outputs[1].token_ids[3]
            params = SamplingParams(
                n=n,
                best_of=width,
                use_beam_search=True,
                temperature=0,
                max_tokens=MAX,
                length_penalty=lp,
                early_stopping=es,
                stop_token_ids=[stop],
                ignore_eos=not real_eos,
            )
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            eos_ids = [stop, tok.eos_token_id] if real_eos else [stop]
            ref = hf_beams(hf, out.prompt_token_ids, width, n, lp, es, eos_ids)
            ours = [c.token_ids for c in out.outputs]
            assert ours == ref, (width, n, lp, es, prompt)
            finished_early += sum(len(c.token_ids) < MAX for c in out.outputs)
            for c in out.outputs:
                assert c.finish_reason == ("stop" if c.token_ids[-1] == stop else "length")
                assert c.stop_reason == (stop if c.finish_reason == "stop" else None)
    assert finished_early >= 10  # the finished-hypothesis logic really ran


def test_beam_outputs_scores_and_logprobs(setup):
    llm, _ = setup
    params = SamplingParams(
        n=3,
        best_of=3,
        use_beam_search=True,
        temperature=0,
        max_tokens=6,
        logprobs=2,
        length_penalty=0.7,
    )
    out = llm.generate(tiny_models.PROMPTS[6], params, use_tqdm=False)[0]
    scores = []
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 6
        assert (
            abs(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)) - (c.cumulative_logprob))
            < 1e-4
        )
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
        scores.append(c.cumulative_logprob / len(c.token_ids) ** 0.7)
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_beam_search_under_swap_preemption(setup, tiny_model_dirs):
    llm, _ = setup
    path = llm.llm_engine.model_config.model
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=MAX)
    prompts = tiny_models.PROMPTS
    expected = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    small = LLM(path, block_size=8, num_gpu_blocks_override=40, max_model_len=96, swap_space=0.02)
    got = [[c.token_ids for c in o.outputs] for o in small.generate(prompts, params)]
    scheduler = small.llm_engine.scheduler
    assert scheduler.num_cumulative_preemption > 0, "the cache was meant to force preemption"
    assert got == expected
    assert scheduler.block_manager.get_num_free_gpu_blocks() == 40
    small.shutdown()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(use_beam_search=True, best_of=2, temperature=0.7),
            r"temperature must be 0 when using beam search\.",
        ),
        (
            dict(use_beam_search=True, temperature=0),
            r"best_of must be greater than 1 when using beam search\. Got 1\.",
        ),
        (
            dict(use_beam_search=True, best_of=2, temperature=0, top_k=5),
            r"top_k must be -1 when using beam search\.",
        ),
        (
            dict(use_beam_search=True, best_of=2, temperature=0, top_p=0.9),
            r"top_p must be 1 when using beam search\.",
        ),
        (dict(temperature=0, n=3), r"best_of must be 1 when using greedy sampling\. Got 3\."),
        (
            dict(temperature=0.5, early_stopping=True),
            r"early_stopping is not effective and must be False when not using beam search\.",
        ),
        (
            dict(temperature=0.5, length_penalty=0.5),
            r"length_penalty is not effective and must be the default value of 1\.0",
        ),
        (
            dict(n=3, best_of=2),
            r"best_of must be greater than or equal to n, got n=3 and best_of=2\.",
        ),
    ],
)
def test_invalid_combinations_raise_vllm_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
