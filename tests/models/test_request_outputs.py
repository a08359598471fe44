"""What each RequestOutput carries: vLLM's output kinds (CUMULATIVE every step, DELTA only the
new tokens and text, FINAL_ONLY one output at the end, which LLM.generate uses) and the
request timings in `RequestOutput.metrics`."""

from __future__ import annotations

import gc

import pytest

from tests.utils import tiny_models
from vllm import LLM, SamplingParams
from vllm.sampling_params import RequestOutputKind

KIND = "opt-pre"
PROMPT = tiny_models.PROMPTS[5]


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    engine = LLM(tiny_model_dirs[KIND], kv_cache_space=0.05, swap_space=0.01, seed=0)
    yield engine
    engine.shutdown()


def stream(llm: LLM, params: SamplingParams, request_id: str) -> list:
    """Every RequestOutput the engine returns for one request, step by step."""
    engine = llm.llm_engine
    engine.add_request(request_id, PROMPT, params)
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(o for o in engine.step() if o.request_id == request_id)
    return seen


def params(kind: RequestOutputKind, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0)
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 12), output_kind=kind, **kwargs)


def test_cumulative_is_the_default_and_grows_every_step(llm):
    assert SamplingParams().output_kind == RequestOutputKind.CUMULATIVE
    seen = stream(llm, params(RequestOutputKind.CUMULATIVE), "cum")
    assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, 13))
    assert [o.finished for o in seen] == [False] * 11 + [True]


def test_final_only_returns_one_output_equal_to_the_last_cumulative(llm):
    cumulative = stream(llm, params(RequestOutputKind.CUMULATIVE), "c")[-1]
    final = stream(llm, params(RequestOutputKind.FINAL_ONLY), "f")
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs == cumulative.outputs


@pytest.mark.parametrize(
    "extra",
    [{}, {"logprobs": 2}, {"stop": "never-seen-xyz"}, {"n": 2, "temperature": 1.0, "seed": 3}],
    ids=["plain", "logprobs", "held-back-stop", "n2"],
)
def test_delta_outputs_concatenate_to_the_cumulative_result(llm, extra):
    # Same seed for both runs, so sampled (n=2) requests draw the same tokens.
    full = stream(llm, params(RequestOutputKind.CUMULATIVE, **extra), "full")[-1]
    deltas = stream(llm, params(RequestOutputKind.DELTA, **extra), "delta")
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    for completion in full.outputs:
        parts = [c for o in deltas for c in o.outputs if c.index == completion.index]
        assert "".join(c.text for c in parts) == completion.text
        assert [t for c in parts for t in c.token_ids] == completion.token_ids
        # Every step brings exactly one token per sequence.
        assert all(len(c.token_ids) == 1 for c in parts)
        if completion.logprobs is not None:
            assert [lp for c in parts for lp in c.logprobs] == completion.logprobs
        assert parts[-1].cumulative_logprob == completion.cumulative_logprob
        assert parts[-1].finish_reason == completion.finish_reason


def test_generate_returns_final_outputs_and_leaves_the_callers_params_alone(llm):
    mine = SamplingParams(temperature=0, max_tokens=12)
    [out] = llm.generate(PROMPT, mine, use_tqdm=False)
    assert mine.output_kind == RequestOutputKind.CUMULATIVE
    assert out.finished and out.outputs == stream(llm, mine, "ref")[-1].outputs


def test_metrics_are_ordered_timestamps(llm):
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time < m.last_token_time == m.finished_time
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)


def test_metrics_of_unfinished_outputs_are_snapshots(llm):
    seen = stream(llm, params(RequestOutputKind.CUMULATIVE, max_tokens=4), "snap")
    assert all(o.metrics.finished_time is None for o in seen[:-1])
    assert seen[-1].metrics.finished_time is not None
    # Each output kept the time of its own step.
    times = [o.metrics.last_token_time for o in seen]
    assert times == sorted(times) and times[0] == seen[0].metrics.first_token_time


def test_too_long_prompt_is_finished_with_a_time(tiny_model_dirs):
    llm = LLM(tiny_model_dirs[KIND], kv_cache_space=0.05, swap_space=0.01, max_model_len=16)
    try:
        [out] = llm.generate(prompt_token_ids=[list(range(5, 40))], use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.outputs[0].finish_reason == "length" and out.metrics.finished_time is not None


def test_generate_keeps_preexisting_objects_out_of_the_gc_only_while_it_runs(llm):
    frozen_during = []

    def spy(token_ids, logits):
        frozen_during.append(gc.get_freeze_count())
        return logits

    llm.generate(PROMPT, SamplingParams(max_tokens=2, logits_processors=[spy]), use_tqdm=False)
    assert frozen_during and min(frozen_during) > 0
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("final", TypeError, "output_kind must be a RequestOutputKind"),
        (True, TypeError, "output_kind must be a RequestOutputKind"),
        (7, ValueError, "output_kind must be one of"),
    ],
)
def test_bad_output_kind(value, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(output_kind=value)


def test_plain_int_output_kind_is_accepted():
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY


def test_delta_with_beam_search_is_refused():
    with pytest.raises(ValueError, match="DELTA is not supported with beam search"):
        SamplingParams(n=2, use_beam_search=True, temperature=0, output_kind=1)
