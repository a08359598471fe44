"""A pipeline that survives: stages killed three ways mid-generation (ray.kill, SIGKILL of the
process, SIGSTOP), at PP = 2 and 3. With restarts the failed stage is replaced and every
request finishes with exactly the fault-free greedy and seeded outputs; with restarts off the
engine fails with one clear error naming the stage, releases everything at once, and a new LLM
builds right away. Ctrl-C inside generate() or step() leaves the engine usable."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

from tests.utils import tiny_models
from tests.utils.faults import after_steps, gone, kill_stage
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.resilience.errors import EngineDeadError

# Stages are killed and replaced here: engines keep a warm spare, as in production (conftest).
WARM_SPARES = True

pytestmark = pytest.mark.ray

PROMPTS = tiny_models.PROMPTS * 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# Half greedy, half seeded random: both must come out exactly as in a fault-free run.
PARAMS = [
    GREEDY if i % 2 == 0 else SamplingParams(temperature=1.0, seed=i, max_tokens=40)
    for i in range(len(PROMPTS))
]
MODES = ("ray.kill", "SIGKILL", "SIGSTOP")


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


# Class scope: the engine (up to 3 of the session's 4 Ray CPUs) is gone before other tests.
@pytest.fixture(scope="class", params=[2, 3], ids=["pp2", "pp3"])
def survivor(request, ray_session, tiny_model_dirs):
    """An engine with the default 3 restarts, and its fault-free outputs."""
    llm = LLM(
        tiny_model_dirs["llama-gqa-tied"],
        pipeline_parallel_size=request.param,
        disable_log_stats=True,
    )
    reference = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    yield llm, reference
    llm.shutdown()


class TestStageReplacement:
    """The three kill modes in turn on one engine per PP size (3 restarts: the default), then
    a request whose logits processor raises on the replaced stages."""

    @pytest.mark.parametrize("mode", MODES)
    def test_killed_stage_is_replaced_and_nothing_is_lost(self, survivor, mode):
        llm, reference = survivor
        pp = llm.llm_engine.parallel_config.pipeline_parallel_size
        # A different victim each time: the last stage, the first, a middle one (PP=3).
        rank = {"ray.kill": pp - 1, "SIGKILL": 0, "SIGSTOP": pp // 2}[mode]
        events_before = len(llm.llm_engine.fault_events)
        executor = llm.llm_engine.executor
        [standby] = executor.standby  # the warm actor that takes a failed rank (CPU)
        victim: list[int] = []
        thread = after_steps(llm, 4, lambda: victim.append(kill_stage(llm, rank, mode)))
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        thread.join(timeout=60)
        assert victim, "the stage was never killed"
        events = llm.llm_engine.fault_events[events_before:]
        assert len(events) == 1, events
        assert events[0].ranks == [rank]
        assert f"pid {victim[0]}" in events[0].message
        # Dead stages are seen when Ray reports them, a frozen one by the heartbeat: both long
        # before the 60 s step deadline (timings are the benchmarks' job: loose bounds here).
        assert events[0].detected_after_s < 30
        assert events[0].recovery_s is not None
        assert token_ids(outputs) == reference
        assert all(o.finished for o in outputs) and len(outputs) == len(PROMPTS)
        assert gone(victim[0])
        # The standby took the rank, and a new standby waits for the next failure.
        assert executor.workers[rank] is standby
        assert len(executor.standby) == 1 and executor.standby[0] is not standby
        # Nothing left over in the engine.
        scheduler = llm.llm_engine.scheduler
        assert not scheduler.in_flight and not scheduler.has_unfinished_seqs()
        assert scheduler.block_manager.get_num_free_gpu_blocks() == (
            scheduler.block_manager.num_total_gpu_blocks
        )

    def test_failing_logits_processor_fails_its_request_not_the_stage(self, survivor):
        """A logits processor that raises is the request's fault: that request ends (aborted,
        the error kept for its caller), no stage is replaced, the others complete unchanged.
        (After the kills above: the replaced stages serve it like the first ones.)"""
        llm, _ = survivor
        engine = llm.llm_engine
        events_before = len(engine.fault_events)
        innocent = PROMPTS[1:6]
        reference = token_ids(llm.generate(innocent, GREEDY, use_tqdm=False))

        def poisoned(output_ids, logits):  # a closure: sent to the last stage by cloudpickle
            raise ValueError("this logits processor always fails")

        bad = SamplingParams(temperature=0.0, max_tokens=8, logits_processors=[poisoned])
        outputs = llm.generate([PROMPTS[0], *innocent], [bad] + [GREEDY] * len(innocent))
        assert engine.fault_events[events_before:] == []
        assert outputs[0].outputs[0].finish_reason == "abort"
        error = engine.pop_request_error(outputs[0].request_id)
        assert error is not None and "this logits processor always fails" in str(error)
        assert token_ids(outputs[1:]) == reference


@pytest.mark.parametrize("mode", ["SIGKILL", "SIGSTOP"])
def test_fail_stop_names_the_stage_and_releases_everything(
    mode, ray_session, tiny_model_dirs, hf_reference
):
    model = tiny_model_dirs["opt-pre"]
    llm = LLM(
        model,
        pipeline_parallel_size=2,
        max_stage_restarts=0,
        step_timeout_s=5,
        disable_log_stats=True,
    )
    infos = llm.llm_engine.get_stage_infos()
    thread = after_steps(llm, 3, lambda: kill_stage(llm, 1, mode))
    started = time.monotonic()
    with pytest.raises(EngineDeadError) as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    elapsed = time.monotonic() - started
    thread.join(timeout=60)
    message = str(info.value)
    assert infos[1].layers is not None
    start, end = infos[1].layers
    assert f"stage 1 (rank 1, layers [{start}, {end})" in message
    assert f"pid {infos[1].pid}" in message and f"node {infos[1].host}" in message
    assert "max_stage_restarts=0" in message
    assert elapsed < 20, f"the failure took {elapsed:.1f} s to surface"
    # Released at once: no stage process left, and the engine refuses further work.
    deadline = time.monotonic() + 10
    while not all(gone(i.pid) for i in infos) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(i.pid) for i in infos)
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    # A new LLM in the same process builds without waiting for the old one's resources.
    started = time.monotonic()
    fresh = LLM(model, pipeline_parallel_size=2, disable_log_stats=True)
    assert time.monotonic() - started < 30
    outputs = fresh.generate(tiny_models.PROMPTS, SamplingParams(temperature=0, max_tokens=32))
    assert token_ids(outputs) == hf_reference("opt-pre")
    fresh.shutdown()


@pytest.fixture(scope="class")
def interruptible(request, ray_session, tiny_model_dirs):
    """An engine at PP = `request.param` (Ray at 2) and its outputs of PARAMS, shared by the
    Ctrl-C tests: each checks that the engine is left usable, for the next one too. (Class
    scope: the Ray engine is gone before the tests after them start theirs.)"""
    llm = LLM(tiny_model_dirs["llama-gqa-untied"], pipeline_parallel_size=request.param)
    reference = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    yield llm, reference
    llm.shutdown()


class TestCtrlC:
    """Ctrl-C inside generate() and inside step(), on one engine per PP size."""

    @pytest.mark.parametrize("interruptible", [1, 2], indirect=True, ids=["pp1", "pp2"])
    def test_ctrl_c_inside_generate_leaves_the_llm_usable(self, interruptible):
        llm, reference = interruptible
        thread = after_steps(llm, 5, lambda: os.kill(os.getpid(), signal.SIGINT))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        thread.join(timeout=10)
        engine = llm.llm_engine
        scheduler = engine.scheduler
        # The interrupted call's requests are gone; nothing is counted in flight.
        state = (
            f"in_flight={scheduler.in_flight} waiting={len(scheduler.waiting)} "
            f"running={len(scheduler.running)} swapped={len(scheduler.swapped)} "
            f"engine_in_flight={len(engine.batch_queue)} pending={len(engine._pending_outputs)}"
        )
        assert not scheduler.in_flight and not engine.has_unfinished_requests(), state
        assert scheduler.block_manager.get_num_free_gpu_blocks() == (
            scheduler.block_manager.num_total_gpu_blocks
        ), state
        assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference

    @pytest.mark.parametrize("interruptible", [2], indirect=True, ids=["pp2"])
    def test_ctrl_c_inside_step_requeues_in_flight_requests(self, interruptible):
        """LLMEngine users keep their requests: after the interrupt, stepping on finishes them
        with the same tokens."""
        llm, reference = interruptible
        engine = llm.llm_engine
        for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
            engine.add_request(str(i), prompt, params)
        finished = {}
        interrupted = 0
        thread = after_steps(llm, 6, lambda: os.kill(os.getpid(), signal.SIGINT))
        while engine.has_unfinished_requests():
            try:
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
            except KeyboardInterrupt:
                interrupted += 1
        thread.join(timeout=10)
        assert interrupted == 1
        assert token_ids(finished[str(i)] for i in range(len(PROMPTS))) == reference


def test_failure_that_recurs_after_a_replacement_is_not_replayed(ray_session, tiny_model_dirs):
    """A stage that raises on a request's step is replaced and the step replayed once; when
    the new stage raises the same error on a step of the same request, that step's requests
    end (aborted, the error logged) instead of replaying until the restart budget is gone: the
    replacement is not counted, the engine and the other requests go on unchanged."""
    llm = LLM(tiny_model_dirs["llama-gqa-tied"], pipeline_parallel_size=2, max_stage_restarts=1)
    try:
        innocent = PROMPTS[1:6]
        reference = token_ids(llm.generate(innocent, GREEDY, use_tqdm=False))

        class StageBreaker(BaseException):
            """Not an Exception: escapes the sampler's per-request attribution, so the stage
            fails (defined here so that cloudpickle sends it by value)."""

        def poisoned(output_ids, logits):  # a closure: sent to the last stage by cloudpickle
            raise StageBreaker("this logits processor always fails")

        bad = SamplingParams(temperature=0.0, max_tokens=8, logits_processors=[poisoned])
        start = time.monotonic()
        outputs = llm.generate([PROMPTS[0], *innocent], [bad] + [GREEDY] * len(innocent))
        assert time.monotonic() - start < 60  # no step deadline was waited out
        engine = llm.llm_engine
        assert not engine.is_dead
        events = engine.fault_events
        assert len(events) == 2 and not events[0].recurring and events[1].recurring, events
        assert "this logits processor always fails" in events[1].message
        assert events[0].signature == events[1].signature
        assert outputs[0].outputs[0].finish_reason == "abort"
        failed_with_it = set(events[1].step_request_ids)
        completed = 0
        for out, ref in zip(outputs[1:], reference):
            if out.outputs[0].finish_reason == "abort":  # it shared the poisoned step twice
                assert out.request_id in failed_with_it
            else:
                assert list(out.outputs[0].token_ids) == ref
                completed += 1
        assert completed >= len(innocent) // 2, outputs
        # max_stage_restarts=1 was used once, by the first failure only: serving goes on.
        assert token_ids(llm.generate(innocent, GREEDY, use_tqdm=False)) == reference
    finally:
        llm.shutdown()


def test_error_inside_a_step_leaves_the_engine_usable(tiny_model_dirs):
    """Any exception out of a step (here a worker error at PP=1) re-queues what was in flight."""
    llm = LLM(tiny_model_dirs["opt-pre"])
    reference = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    worker = llm.llm_engine.executor.worker
    real = worker.execute_model
    calls = []

    def flaky(request):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected worker error")
        return real(request)

    worker.execute_model = flaky
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(str(i), prompt, params)
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished_requests():
            engine.step()
    assert not engine.scheduler.in_flight
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert token_ids(finished[str(i)] for i in range(len(PROMPTS))) == reference
    llm.shutdown()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kv_cache_space": 10000}, "Too large KV cache space"),
        ({"swap_space": 10000}, "Too large swap space"),
        ({"device": "cuda"}, "no CUDA GPU is available"),
        ({"max_stage_restarts": -1}, "max_stage_restarts"),
        ({"step_timeout_s": 0}, "step_timeout_s"),
    ],
)
def test_resource_errors_up_front(kwargs, match, tiny_model_dirs):
    started = time.monotonic()
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=tiny_model_dirs["opt-pre"], **kwargs).create_engine_config()
    assert time.monotonic() - started < 5


def test_restart_budget_is_a_rate(tiny_model_dirs, monkeypatch):
    """max_stage_restarts counts replacements within VLLM_STAGE_RESTART_WINDOW_S: faults
    spread out over a long-lived engine never use it up, a burst still does. (The executor's
    replacement is stubbed: this is the engine's bookkeeping.)"""
    from vllm.resilience.errors import StageFailedError, StageFailure

    llm = LLM(tiny_model_dirs["opt-pre"], max_stage_restarts=2)
    engine = llm.llm_engine
    # An in-process executor given a stage control whose replacement always works.
    replacing = SimpleNamespace(replace_stages=lambda ranks: 0.01, refill_spares=lambda: None)
    monkeypatch.setattr(type(engine.executor), "stage_control", property(lambda _: replacing))
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setenv("VLLM_STAGE_RESTART_WINDOW_S", "600")

    def fault() -> None:
        engine._recover(StageFailedError([StageFailure(0, "rank 0", "died")], 0.1))

    try:
        for _ in range(5):  # one fault every 7 minutes: never more than 2 in 10 minutes
            fault()
            clock[0] += 420.0
        assert not engine.is_dead and len(engine.fault_events) == 5
        fault()
        clock[0] += 1.0
        fault()  # three within the window: the budget of 2 is used up
        raise AssertionError("the third restart within the window was allowed")
    except EngineDeadError as exc:
        assert "max_stage_restarts=2 restarts within 600 s used up" in str(exc)
    finally:
        monkeypatch.undo()
        llm.shutdown()


def test_backend_that_cannot_replace_a_stage_says_so(tiny_model_dirs, caplog):
    """A stage failure on an executor without stage replacement (uni: one in-process rank) stops
    the engine naming the reason, without first logging that it replaces the stage."""
    from vllm.resilience.errors import StageFailedError, StageFailure

    llm = LLM(tiny_model_dirs["opt-pre"])
    engine = llm.llm_engine
    with caplog.at_level("WARNING", logger="vllm"):
        with pytest.raises(EngineDeadError, match="UniProcExecutor cannot replace a stage"):
            engine._recover(StageFailedError([StageFailure(0, "rank 0", "died")], 0.1))
    assert not any("Replacing failed stage" in r.getMessage() for r in caplog.records)
    llm.shutdown()
