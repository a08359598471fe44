"""Speculative decoding (prompt lookup) on one stage, against HF and against the same engine
without speculation: greedy tokens equal HF's; seeded samples, `n`/`best_of`, logprobs, stop
strings and structured outputs equal the run without speculation (each position draws from
its own seeded stream); preemption under a small KV cache; and, on a tiny vocabulary, the
acceptance rule's output distribution is the target's (chi-square)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import REGISTRY

from tests.utils import tiny_models
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.sampler import Sampler
from vllm.model_executor.sampling_metadata import build_sampling_metadata
from vllm.sampling_params import StructuredOutputsParams
from vllm.sequence import SequenceData, SequenceGroupMetadata
from vllm.spec_decode.verify import accept_drafts

KIND = "llama-gqa-tied"
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
# Chunked prefill with small steps and prefix caching on: verify steps share batches with
# prefill chunks, and prompts share cached blocks.
ENGINE = dict(
    enable_chunked_prefill=True,
    max_num_batched_tokens=64,
    max_num_seqs=16,
    enable_prefix_caching=True,
    num_gpu_blocks_override=48,
    disable_log_stats=False,
)
REGEX = r"(ab|cd){3,8}x"
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a", "b"],
}


@pytest.fixture(scope="module")
def engines(tiny_model_dirs) -> Iterator[tuple[LLM, LLM]]:
    """(with speculation, without), same model and settings."""
    model = tiny_model_dirs[KIND]
    plain = LLM(model, **ENGINE)
    spec = LLM(model, speculative_config=SPEC, **ENGINE)
    yield spec, plain
    spec.shutdown()
    plain.shutdown()


def _counter(name: str, model: str) -> float:
    return REGISTRY.get_sample_value(f"vllm:{name}_total", {"model_name": model}) or 0.0


def _both(engines: tuple[LLM, LLM], prompts, params) -> tuple[list, list]:
    spec, plain = engines
    return (
        spec.generate(prompts, params, use_tqdm=False),
        plain.generate(prompts, params, use_tqdm=False),
    )


def _ids(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def test_greedy_equals_hf_with_drafts_accepted(engines, hf_reference, tiny_model_dirs) -> None:
    spec, _ = engines
    model = tiny_model_dirs[KIND]
    before = _counter("spec_decode_num_accepted_tokens", model)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = spec.generate(tiny_models.PROMPTS, greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_reference(KIND)
    # The drafts were really used (random tiny models fall into loops prompt lookup finds).
    accepted = _counter("spec_decode_num_accepted_tokens", model) - before
    assert accepted >= 50, accepted
    assert _counter("spec_decode_num_draft_tokens", model) >= accepted


def test_sampling_n_best_of_logprobs_and_stops_equal_without_speculation(engines) -> None:
    prompts = tiny_models.PROMPTS[:6]
    params = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, logprobs=3),
        SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(n=2, best_of=3, temperature=0.9, seed=5, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # max_tokens mid-draft
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=3, stop_token_ids=[0]),
    ]
    spec_out, plain_out = _both(engines, prompts, params)
    assert _ids(spec_out) == _ids(plain_out)
    for s, p in zip(spec_out, plain_out):
        for sc, pc in zip(s.outputs, p.outputs):
            assert sc.text == pc.text and sc.finish_reason == pc.finish_reason
            if pc.logprobs is not None:
                for s_entry, p_entry in zip(sc.logprobs, pc.logprobs):
                    assert s_entry.keys() == p_entry.keys()
                    for token, lp in p_entry.items():
                        assert s_entry[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
                        assert s_entry[token].rank == lp.rank
    # A stop string found inside accepted drafts: nothing after it is emitted.
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    text = engines[1].generate(prompts[3], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stops = SamplingParams(temperature=0.0, max_tokens=32, stop=[stop], ignore_eos=True)
    spec_out, plain_out = _both(engines, [prompts[3]], stops)
    assert spec_out[0].outputs[0].text == plain_out[0].outputs[0].text
    assert stop not in spec_out[0].outputs[0].text
    assert spec_out[0].outputs[0].finish_reason == "stop"


def test_structured_outputs_stay_valid_and_equal(engines) -> None:
    so = StructuredOutputsParams
    choice = so(choice=["yes yes yes", "no no no no"])
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=so(json=SCHEMA)),
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so(regex=REGEX)),
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=choice),
        SamplingParams(
            temperature=0.8,
            seed=3,
            max_tokens=30,
            structured_outputs=so(json=SCHEMA, disable_any_whitespace=True),
        ),
    ]
    prompts = ['{"a": 1, "b": "x"} {"a": 1', "abababab cdcdcd ab", "yes yes no yes", '{"a": 2']
    spec_out, plain_out = _both(engines, prompts, params)
    assert _ids(spec_out) == _ids(plain_out)
    texts = [o.outputs[0].text for o in spec_out]
    for index in (0, 3):
        if spec_out[index].outputs[0].finish_reason == "stop":
            assert set(json.loads(texts[index])) == {"a", "b"}
    assert (
        re.fullmatch(r"(ab|cd){3,8}x", texts[1]) or spec_out[1].outputs[0].finish_reason == "length"
    )
    assert texts[2] in ("yes yes yes", "no no no no")


def test_preemption_keeps_outputs(engines) -> None:
    """More work than the 48 blocks hold: groups are preempted (recompute) mid-speculation."""
    spec, plain = engines
    prompts = [p * 6 for p in tiny_models.PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    before = spec.llm_engine.scheduler.num_cumulative_preemption
    spec_out, plain_out = _both(engines, prompts, greedy)
    assert _ids(spec_out) == _ids(plain_out)
    assert spec.llm_engine.scheduler.num_cumulative_preemption > before


def _meta(request_id: str, drafts: list[int], params: SamplingParams) -> SequenceGroupMetadata:
    data = SequenceData([1, 2, 3], [4])
    data.update_num_computed_tokens(3)
    return SequenceGroupMetadata(
        request_id, False, {0: data}, params, {0: [0]}, draft_token_ids={0: drafts}
    )


def test_acceptance_gives_the_target_distribution() -> None:
    """Chi-square on a 5-token vocabulary: the first emitted token follows p0 whatever the
    draft, and the second (after an accepted draft) follows p1."""
    torch.manual_seed(0)
    p0 = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    trials, draft = 6000, [1, 4]
    params = SamplingParams(temperature=1.0, max_tokens=10)
    metas = [_meta(str(i), draft, params) for i in range(trials)]
    md = build_sampling_metadata(metas, list(range(trials)), {}, torch.device("cpu"))
    # Rows per request: positions 0, 1, 2 (p0, p1, and p1 again for the bonus).
    logits = torch.stack([p0.log(), p1.log(), p1.log()] * trials)
    outputs = accept_drafts(Sampler()(logits, md), md.verified)
    first = torch.zeros(5)
    second = torch.zeros(5)
    for out in outputs:
        sample = out.samples[0]
        emitted = [t for t, _ in sample.accepted or []] + [sample.output_token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    for counts, p in ((first, p0), (second, p1)):
        expected = p * counts.sum()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        # 4 degrees of freedom: P(chi2 > 18.47) = 0.001.
        assert chi2 < 18.47, (counts, expected)
    # About p0[1] = 40% of the first drafts are accepted.
    assert second.sum() == pytest.approx(0.4 * trials, rel=0.1)


@pytest.mark.parametrize("draft", ["same", "other"])
def test_draft_model(draft, tiny_model_dirs, hf_reference, caplog) -> None:
    """A draft model in a rank of its own: the target's own weights (every draft accepted),
    or another random model (none accepted: speculation pauses itself, and says so); greedy
    tokens equal HF's either way."""
    model = tiny_model_dirs[KIND]
    other = tiny_model_dirs["llama-gqa-untied"]  # same tokenizer, other weights
    spec = {"model": model if draft == "same" else other, "num_speculative_tokens": 3}
    llm = LLM(model, speculative_config=spec)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        outputs = llm.generate(tiny_models.PROMPTS, greedy, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == hf_reference(KIND)
        totals = llm.llm_engine.scheduler.draft_planner.totals
        assert totals.num_draft_tokens > 0
        if draft == "same":
            assert totals.num_accepted_tokens == totals.num_draft_tokens
        else:
            assert totals.num_accepted_tokens < totals.num_draft_tokens // 10
            assert "Speculative decoding paused" in caplog.text
    finally:
        llm.shutdown()


def test_draft_runner_keeps_rolls_back_and_frees_draft_kv(tiny_model_dirs) -> None:
    """A draft model's stage (`propose_drafts`) over one persistent draft sequence: after
    partial acceptance, full acceptance with a bonus token and a diverging history, each
    proposal equals HF's greedy continuation of the tokens it was given; a finished request's
    blocks come back; when blocks run out the least recently used sequence is evicted, and a
    sequence longer than the whole cache gets no drafts."""
    from vllm.distributed.rank_verbs import Verb
    from vllm.engine.arg_utils import EngineArgs
    from vllm.executor.uniproc_executor import UniProcExecutor

    model = tiny_model_dirs[KIND]
    config = EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        block_size=16,
        num_gpu_blocks_override=8,
        max_model_len=128,
    ).create_engine_config()
    executor = UniProcExecutor(config)
    hf = tiny_models.load_hf(model)
    k = 4

    def propose(requests, finished=()):
        return executor.collective_rpc(Verb.PROPOSE_DRAFTS, (requests, list(finished)))[0]

    def greedy(ids):
        return tiny_models.hf_greedy_ids(hf, [ids], k)[0]

    try:
        prompt = list(range(5, 45))  # 40 tokens: 3 blocks with the drafts
        history = [prompt]
        drafts = propose([("a", 0, prompt, k)])[0]
        assert drafts == greedy(prompt)
        rejected = (drafts[2] + 1) % 100  # the target sampled another token at position 2
        history.append(prompt + drafts[:2] + [rejected])
        drafts = propose([("a", 0, history[-1], k)])[0]
        assert drafts == greedy(history[-1])
        history.append(history[-1] + drafts + greedy(history[-1] + drafts)[:1])  # + bonus
        drafts = propose([("a", 0, history[-1], k)])[0]
        assert drafts == greedy(history[-1])
        diverged = prompt[:20] + [7, 8, 9]  # recomputed with another history
        assert propose([("a", 0, diverged, k)])[0] == greedy(diverged)

        runner = executor.worker.draft_runner
        # 51 tokens at most (48 + 3 drafts): 4 blocks, kept by the sequence when it rolls back.
        assert runner is not None and runner.num_free_blocks == 8 - 4
        propose([], finished=["a"])
        assert runner.num_free_blocks == 8 and runner.num_seqs == 0

        # 8 blocks: "b" and "c" take 4 each; "d" evicts "b" (the least recently used).
        long_ids = [list(range(10 + i, 70 + i)) for i in range(3)]  # 60 tokens + 3 drafts
        out = propose([("b", 0, long_ids[0], k), ("c", 0, long_ids[1], k)])
        assert out == [greedy(long_ids[0]), greedy(long_ids[1])]
        assert propose([("d", 0, long_ids[2], k)])[0] == greedy(long_ids[2])
        assert runner.num_seqs == 2
        assert propose([("e", 0, list(range(126)), k)]) == [[]]  # 9 blocks: never fits
    finally:
        executor.shutdown()
