"""The asynchronous pipeline at PP > 1: decodes scheduled ahead of their previous output, the
last stage's sampled ids sent straight to the first stage, and deltas instead of histories.

Greedy output equals HF; seeded sampling with penalties, n > 1 and beam search equal the
synchronous pipeline's; a stop token ends generation exactly where it occurs (tokens sampled
ahead past it are never shown); aborts while two steps are in flight lose nothing else. One
engine per PP size is shared by the tests of this module.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.utils import tiny_models
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.ray

KIND = "llama-gqa-untied"
MANY = [p for _ in range(4) for p in tiny_models.PROMPTS]


@pytest.fixture(scope="module", params=[(2, "ray"), (3, "ray"), (2, "mp")], ids=str)
def async_llm(request, ray_session, tiny_model_dirs):
    pp, backend = request.param
    llm = LLM(
        tiny_model_dirs[KIND],
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        kv_cache_space=0.05,
        swap_space=0.01,
    )
    engine = llm.llm_engine
    assert engine.batch_queue.async_pipeline and engine.scheduler.schedule_ahead
    # One budget, built by the engine, sizes the micro-batches and the queue alike.
    assert engine.scheduler.budget.cohorts == pp
    assert engine.batch_queue.max_concurrent_batches == 2 * pp
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def sync_results(ray_session, tiny_model_dirs):
    """The synchronous pipeline's outputs (its engine is shut down before the next PP size
    starts: the session's Ray has 4 CPUs)."""
    llm = LLM(
        tiny_model_dirs[KIND],
        pipeline_parallel_size=2,
        async_scheduling=False,
        kv_cache_space=0.05,
        swap_space=0.01,
    )
    queue = llm.llm_engine.batch_queue
    assert not queue.async_pipeline
    greedy = llm.generate(
        tiny_models.PROMPTS, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False
    )
    results = {
        "greedy": [o.outputs[0].token_ids for o in greedy],
        "ahead_groups": queue.reset_stats().ahead_groups,
        "sampling": llm.generate(tiny_models.PROMPTS, _sampling_params(), use_tqdm=False),
    }
    llm.shutdown()
    return results


def _ids(outputs):
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def test_greedy_equals_hf_with_steps_ahead(async_llm, hf_reference):
    queue = async_llm.llm_engine.batch_queue
    queue.reset_stats()
    queue.count_bytes = True
    reference = hf_reference(KIND)
    outputs = async_llm.generate(
        MANY, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False
    )
    queue.count_bytes = False
    tokenizer = async_llm.get_tokenizer()
    for i, out in enumerate(outputs):
        ref = reference[i % len(tiny_models.PROMPTS)]
        assert out.outputs[0].token_ids == ref, f"prompt {i}"
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    stats = queue.reset_stats()
    # Most decode micro-batches went ahead of their previous output.
    assert stats.ahead_groups > 0.5 * len(MANY) * 30
    # Step records: far fewer bytes than full histories (new requests are sent once).
    assert stats.step_bytes * 3 < stats.full_bytes, stats
    engine = async_llm.llm_engine
    assert not engine.scheduler.in_flight and not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == (
        engine.cache_config.num_gpu_blocks
    )


def test_short_then_long_generate_never_waits_on_ids_not_yet_taken(async_llm, hf_reference):
    """The last stage sends the ids of every step; the first stage takes them only when a
    later step asks it to. With the last stage waiting for its previous send, a short run
    followed by a longer one deadlocked (SmolLM2, PP=2 on mp: the engine waited for the last
    stage, the last stage for ids the first stage would take only in a later step)."""
    reference = hf_reference(KIND)
    short = async_llm.generate(
        tiny_models.PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in short] == [r[:8] for r in reference[:4]]
    outputs = async_llm.generate(
        MANY, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False
    )
    for i, out in enumerate(outputs):
        assert out.outputs[0].token_ids == reference[i % len(tiny_models.PROMPTS)][:24]
    assert not async_llm.llm_engine.fault_events


def test_stop_token_inside_steps_ahead_is_exact(async_llm, hf_reference):
    """Stop at the k-th generated token: what was sampled ahead past it is discarded."""
    reference = hf_reference(KIND)
    params, expected = [], []
    for i, ref in enumerate(reference * 2):
        k = 3 + (5 * i) % 20
        stop = ref[k]
        first = ref.index(stop)
        params.append(SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop]))
        expected.append(ref[: first + 1])
    outputs = async_llm.generate(tiny_models.PROMPTS * 2, params, use_tqdm=False)
    for out, exp in zip(outputs, expected):
        assert list(out.outputs[0].token_ids) == exp
        assert out.outputs[0].finish_reason == "stop"
    engine = async_llm.llm_engine
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == (
        engine.cache_config.num_gpu_blocks
    )


def test_closure_logits_processor_reaches_the_last_stage(async_llm, hf_reference):
    """A logits processor defined inside a function (plain pickle refuses it) crosses to the
    last stage on every backend: the engine's calls fall back to cloudpickle, as Ray's did."""
    reference = hf_reference(KIND)[0]
    at = 5
    # A token greedy decoding would not pick there, forced at the 6th position.
    forced = next(t for t in reference if t != reference[at])

    def force(output_ids: list[int], logits):
        if len(output_ids) == at:
            logits[forced] = 1e4
        return logits

    out = async_llm.generate(
        tiny_models.PROMPTS[:1],
        SamplingParams(temperature=0.0, max_tokens=at + 1, logits_processors=[force]),
        use_tqdm=False,
    )[0].outputs[0]
    assert list(out.token_ids) == reference[:at] + [forced]
    assert not async_llm.llm_engine.fault_events


class _HoldsALock:
    """A logits processor neither pickle nor cloudpickle can serialise (it holds a lock); with
    `lock_now=False` one that serialises until its `lock` is set (the engine's backstop)."""

    def __init__(self, lock_now: bool = True) -> None:
        self.lock = threading.Lock() if lock_now else None

    def __call__(self, output_ids, logits):
        return logits


def _run_until_done(engine, request_ids: set[str], timeout_s: float = 120.0) -> dict:
    outputs, deadline = {}, time.monotonic() + timeout_s
    while request_ids - set(outputs) and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return outputs


def test_unpicklable_logits_processor_refused_at_add_request(async_llm, hf_reference):
    """A request the engine could not send to its stages is refused at add_request with a
    TypeError naming the field, at once; a request already running completes untouched."""
    engine = async_llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    engine.add_request("concurrent", tiny_models.PROMPTS[0], greedy)
    engine.step()  # the concurrent request is inside the pipeline
    start = time.monotonic()
    bad = SamplingParams(temperature=0.0, max_tokens=4, logits_processors=[_HoldsALock()])
    with pytest.raises(TypeError, match=r"logits_processors\[0\] .* cannot be serialised"):
        engine.add_request("unsendable", tiny_models.PROMPTS[1], bad)
    assert time.monotonic() - start < 1.0
    done = _run_until_done(engine, {"concurrent"})
    assert list(done["concurrent"].outputs[0].token_ids) == hf_reference(KIND)[0][:16]
    assert not engine.has_unfinished_requests()
    assert not engine.fault_events


def test_step_that_cannot_be_serialised_sends_nothing(async_llm, hf_reference):
    """The backstop: a processor that became unpicklable after add_request. Nothing of its
    step is sent (every rank's part is serialised first), so no stage waits for a step its
    neighbour never got: its request ends aborted at once, the others in the same step are
    recomputed and equal HF, and no stage is treated as failed."""
    engine = async_llm.llm_engine
    processor = _HoldsALock(lock_now=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    engine.add_request("a", tiny_models.PROMPTS[0], greedy)
    engine.add_request(
        "poisoned",
        tiny_models.PROMPTS[1],
        SamplingParams(temperature=0.0, max_tokens=16, logits_processors=[processor]),
    )
    engine.add_request("b", tiny_models.PROMPTS[2], greedy)
    # Unpicklable from now on, before the request's first step carries its parameters.
    processor.lock = threading.Lock()
    start = time.monotonic()
    done = _run_until_done(engine, {"a", "poisoned", "b"})
    assert done["poisoned"].outputs[0].finish_reason == "abort"
    reference = hf_reference(KIND)
    assert list(done["a"].outputs[0].token_ids) == reference[0][:16]
    assert list(done["b"].outputs[0].token_ids) == reference[2][:16]
    assert time.monotonic() - start < 60  # never a step deadline
    assert not engine.fault_events
    # The engine goes on serving.
    out = async_llm.generate(tiny_models.PROMPTS[:1], greedy, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == reference[0][:16]


def test_profiling_writes_a_trace_per_stage(async_llm, hf_reference, tmp_path, monkeypatch):
    """vLLM's profiling: VLLM_TORCH_PROFILER_DIR, then LLM.start_profile/stop_profile; every
    stage (Ray actor or mp process) writes its torch.profiler trace and a table of its ops."""
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="Profiler is not enabled."):
        async_llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    async_llm.start_profile()
    with pytest.raises(RuntimeError, match="Profiler is already running."):
        async_llm.start_profile()
    out = async_llm.generate(
        tiny_models.PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in out] == [r[:4] for r in hf_reference(KIND)[:2]]
    tables = async_llm.stop_profile()
    pp = async_llm.llm_engine.parallel_config.pipeline_parallel_size
    assert sorted(os.path.basename(t) for t in tables) == [
        f"stage{s}-rank{s}-ops.txt" for s in range(pp)
    ]
    for table in tables:
        text = open(table).read()
        assert "Self CPU" in text and "aten::" in text  # the ops each stage ran
    traces = sorted(p.name for p in (tmp_path / "traces").glob("*.pt.trace.json"))
    assert traces == [f"stage{s}-rank{s}.pt.trace.json" for s in range(pp)]
    with pytest.raises(RuntimeError, match="Profiler is not running."):
        async_llm.stop_profile()


def _sampling_params() -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=1.0,
            seed=11,
            max_tokens=24,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
        ),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, n=2),
        SamplingParams(temperature=0.0, max_tokens=12, n=2, best_of=3, use_beam_search=True),
        SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=28, min_tokens=10, logprobs=2),
    ] * 2


def test_sampling_equals_sync_pipeline(sync_results, async_llm):
    """Seeded sampling (penalties read the stages' own token state), n > 1 and beam search
    give exactly what the synchronous pipeline gives."""
    got = async_llm.generate(tiny_models.PROMPTS, _sampling_params(), use_tqdm=False)
    want = sync_results["sampling"]
    assert _ids(got) == _ids(want)
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs):
            assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-4)


def test_abort_while_two_steps_in_flight(async_llm, hf_reference):
    """Aborts and stops while a step scheduled ahead is in flight: every request finishes
    exactly once (no output after its finished one), the others equal HF."""
    engine = async_llm.llm_engine
    reference = hf_reference(KIND)
    prompts = tiny_models.PROMPTS * 2
    params = []
    for i in range(len(prompts)):
        ref = reference[i % len(tiny_models.PROMPTS)]
        stop = [ref[4 + i % 7]] if i % 2 else []  # half stop early on a token of their own
        params.append(SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=stop))
        engine.add_request(f"ab-{i}", prompts[i], params[-1])
    finished: dict[str, list] = {}

    def collect(outputs):
        for out in outputs:
            assert out.request_id not in finished, f"{out.request_id}: output after finishing"
            if out.finished:
                finished.setdefault(out.request_id, []).append(out)

    for _ in range(12):
        collect(engine.step())
    assert len(engine.batch_queue) > engine.parallel_config.pipeline_parallel_size
    aborted = {f"ab-{i}" for i in range(0, len(prompts), 3)}
    engine.abort_request(aborted)
    while engine.has_unfinished_requests():
        collect(engine.step())
    for i in range(len(prompts)):
        rid = f"ab-{i}"
        assert len(finished.get(rid, [])) <= 1, rid
        if rid in aborted:
            continue
        ref = reference[i % len(tiny_models.PROMPTS)]
        if params[i].stop_token_ids:
            ref = ref[: ref.index(params[i].stop_token_ids[0]) + 1]
        assert list(finished[rid][0].outputs[0].token_ids) == ref, rid
    assert not engine.scheduler.in_flight
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == (
        engine.cache_config.num_gpu_blocks
    )


def test_sync_pipeline_sends_no_steps_ahead(sync_results, hf_reference):
    assert sync_results["greedy"] == hf_reference(KIND)
    assert sync_results["ahead_groups"] == 0
