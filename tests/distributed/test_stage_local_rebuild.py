"""Stage-local KV rebuild: a replaced stage re-prefills only its own layers (from the token ids
or the previous stage's boundary cache) while the other stages keep their KV and swap copies.

A stage is SIGKILLed mid-generation (the first, a middle and the last one) with chunked
prefill, prefix caching, a small cache that swaps, and parallel (n=2) seeded sampling: greedy
and seeded outputs equal the fault-free run of the same engine, the log says stage-local, and
the recovery's work in token-stages is at most 1/PP of a full recompute's for the same state.
`stage_recovery="full"` still recovers with equal outputs."""

from __future__ import annotations

import signal

import pytest

from tests.utils import tiny_models
from tests.utils.faults import (
    SWAPPING_ENGINE_KW,
    after_steps,
    gone,
    kill_before_a_step,
    kill_stage_pid,
    swapping_params,
)
from vllm import LLM

# Stages are killed and replaced here: engines keep a warm spare, as in production (conftest).
WARM_SPARES = True

PROMPTS = tiny_models.PROMPTS * 2
PARAMS = swapping_params(len(PROMPTS))
# One engine per layout takes up to 6 kills.
ENGINE_KW = {**SWAPPING_ENGINE_KW, "max_stage_restarts": 8}


def outputs_of(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def start_engine(model: str, backend: str, pp: int, tp: int = 1, **kwargs) -> LLM:
    return LLM(
        model,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        **{**ENGINE_KW, **kwargs},
    )


MODEL = "llama-gqa-untied"


@pytest.fixture(
    scope="module",
    params=[
        "mp-pp2",
        "mp-pp3",
        pytest.param("ray-pp2", marks=pytest.mark.ray),
        pytest.param("ray-pp3", marks=pytest.mark.ray),
    ],
)
def engine(request, tiny_model_dirs):
    """An engine (stage-local recovery: the default) and its fault-free outputs."""
    backend, pp = request.param.split("-")
    if backend == "ray":
        request.getfixturevalue("ray_session")
    llm = start_engine(tiny_model_dirs[MODEL], backend, int(pp[2:]))
    reference = outputs_of(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    yield llm, reference
    llm.shutdown()


def run_with_kill(llm: LLM, rank: int, caplog, steps: int = 6) -> tuple[list, object]:
    """Generate while SIGKILLing `rank` after `steps` steps; (outputs, the fault event)."""
    engine = llm.llm_engine
    events_before = len(engine.fault_events)
    victim: list[int] = []

    def kill() -> None:
        victim.append(kill_stage_pid(llm, rank, signal.SIGKILL))

    thread = after_steps(llm, steps, kill)
    with caplog.at_level("INFO", logger="vllm"):
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    thread.join(timeout=60)
    assert victim, "the stage was never killed"
    assert gone(victim[0])
    events = engine.fault_events[events_before:]
    assert len(events) == 1, events
    scheduler = engine.scheduler
    assert not scheduler.in_flight and not scheduler.has_unfinished_seqs()
    bm = scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    # Every request got its KV back before the run ended, after the stage was replaced.
    event = events[0]
    assert event.recovery_s is not None
    assert event.caught_up_s >= event.recovery_s, event.as_dict()
    assert "Every request is back where it was" in caplog.text
    return outputs, event


def assert_work_is_the_rebuilt_share(extra: dict, pp: int) -> None:
    """The recovery's work is the rebuilt stage's 1/PP share of a full recompute (which
    counts every token whose KV existed), plus the requests recomputed in full (a prompt that
    runs whole, a swapped group with no room to come back): nothing else runs through every
    stage, not even what a lost step swapped or copied."""
    in_full = extra["recomputed_tokens"] - extra["replayed_tokens"]
    share = extra["full_path_token_stages"] // pp
    assert extra["recomputed_token_stages"] == share + in_full * (pp - 1), extra


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_killed_stage_is_rebuilt_alone(engine, where, caplog):
    llm, reference = engine
    pp = llm.llm_engine.parallel_config.pipeline_parallel_size
    if where == "middle" and pp < 3:
        pytest.skip("no middle stage at PP=2")
    rank = {"first": 0, "middle": pp // 2, "last": pp - 1}[where]
    outputs, event = run_with_kill(llm, rank, caplog)
    assert outputs_of(outputs) == reference
    extra = event.as_dict()
    assert extra["stage_recovery"] == "local", extra
    assert extra["rebuilt_stages"] == [rank]
    assert extra["replayed_tokens"] > 0
    assert_work_is_the_rebuilt_share(extra, pp)
    assert extra["recomputed_token_stages"] < extra["full_path_token_stages"], extra
    logged = caplog.text
    assert "rebuilt stage-locally" in logged and "Stage-local rebuild of stage(s)" in logged


@pytest.mark.parametrize("pause_s", [0.0, 0.5])
def test_blocks_a_lost_step_moved_stay_with_the_survivors(engine, pause_s, caplog):
    """The stage is killed just before a step that copies or swaps blocks is submitted.
    Without a pause the step (and the ones after it) reaches the survivors, which apply the
    block operations even of steps after one they failed; after a pause the engine knows the
    stage is gone, the submission fails, and the replay applies them first. Either way the
    survivors' blocks are trusted: only the replaced stage re-prefills."""
    llm, reference = engine
    eng = llm.llm_engine
    pp = eng.parallel_config.pipeline_parallel_size
    events_before = len(eng.fault_events)

    def moves_blocks(out) -> bool:
        return bool(out.blocks_to_copy or out.blocks_to_swap_out)

    with kill_before_a_step(llm, pp - 1, moves_blocks, pause_s) as fired:
        with caplog.at_level("INFO", logger="vllm"):
            outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert fired, "no step copied or swapped a block"
    assert outputs_of(outputs) == reference
    (event,) = eng.fault_events[events_before:]
    extra = event.as_dict()
    assert extra["stage_recovery"] == "local", extra
    assert extra["rebuilt_stages"] == [pp - 1]
    assert_work_is_the_rebuilt_share(extra, pp)


def test_swapped_requests_with_no_room_are_rebuilt_in_rounds(engine, monkeypatch, caplog):
    """Killed before a step that swaps a request out (a pause makes its submission fail, so
    the replay applies the swap-out first), with no room for any swapped request to come
    back with the replay (forced): each stays swapped and is rebuilt in a round -- swapped
    in, replayed on the replaced stage, swapped out again -- instead of being recomputed."""
    import vllm.core.stage_rollback as rollback

    llm, reference = engine
    eng = llm.llm_engine
    pp = eng.parallel_config.pipeline_parallel_size
    monkeypatch.setattr(rollback, "_room_to_swap_in", lambda sched, group: False)
    events_before = len(eng.fault_events)
    with kill_before_a_step(llm, 0, lambda out: bool(out.blocks_to_swap_out), 0.5) as fired:
        with caplog.at_level("INFO", logger="vllm"):
            outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert fired, "no step swapped a request out"
    assert outputs_of(outputs) == reference
    (event,) = eng.fault_events[events_before:]
    extra = event.as_dict()
    assert extra["stage_recovery"] == "local", extra
    assert extra["rebuilt_stages"] == [0]
    assert extra["swap_rounds_requests"] > 0 and not extra["recomputed_requests"], extra
    assert_work_is_the_rebuilt_share(extra, pp)


def test_stage_recovery_full_still_recovers(tiny_model_dirs, caplog):
    llm = start_engine(tiny_model_dirs[MODEL], "mp", 2, stage_recovery="full")
    try:
        reference = outputs_of(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        outputs, event = run_with_kill(llm, 1, caplog)
        assert outputs_of(outputs) == reference
        assert event.stage_recovery == "full"
        assert event.recomputed_token_stages == event.full_path_token_stages
        assert "recomputed with the tokens they have" in caplog.text
    finally:
        llm.shutdown()


def test_tp2_pp2_rebuilds_both_ranks_of_a_stage(tiny_model_dirs, caplog):
    """TP=2 x PP=2 on mp: one TP rank of the first stage dies; the boundary rows are each
    rank's slice."""
    llm = start_engine(tiny_model_dirs[MODEL], "mp", 2, tp=2)
    try:
        reference = outputs_of(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        outputs, event = run_with_kill(llm, 1, caplog)
        assert outputs_of(outputs) == reference
        assert event.stage_recovery == "local"
        assert event.rebuilt_stages == [0]
    finally:
        llm.shutdown()


def test_prompts_in_flight_run_again_and_are_not_counted_as_recomputed(tiny_model_dirs, caplog):
    """Classic scheduling (a prompt runs whole), killed while prompts are in flight: those
    requests are re-queued and run again, but had no KV yet, so they add nothing to the
    tokens recomputed; outputs equal the fault-free run."""
    llm = start_engine(
        tiny_model_dirs[MODEL],
        "mp",
        2,
        enable_chunked_prefill=False,
        max_num_batched_tokens=128,  # several prefill steps for the 16 prompts
        max_num_seqs=4,
        enable_prefix_caching=False,  # a cached prefix would count as KV the prompt had
    )
    try:
        reference = outputs_of(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        outputs, event = run_with_kill(llm, 1, caplog, steps=1)
        assert outputs_of(outputs) == reference
        extra = event.as_dict()
        assert extra["stage_recovery"] == "local", extra
        requeued = extra["recomputed_requests"]
        assert "its prompt runs whole when scheduled again" in requeued.values(), extra
        assert extra["recomputed_tokens"] == extra["replayed_tokens"], extra  # none had KV
        assert_work_is_the_rebuilt_share(extra, 2)
    finally:
        llm.shutdown()


def test_a_whole_prompt_in_flight_keeps_its_cached_prefix(tiny_model_dirs, caplog):
    """Classic scheduling with prefix caching, killed before a step with a prompt that took
    a prefix from the cache: that prompt runs again from the waiting queue, but its cached
    prefix is replayed on the new stage (not recomputed through every stage) and stays
    cached; outputs equal the fault-free run."""
    llm = start_engine(
        tiny_model_dirs[MODEL],
        "mp",
        2,
        enable_chunked_prefill=False,
        max_num_batched_tokens=128,
        max_num_seqs=4,
    )
    try:
        reference = outputs_of(llm.generate(PROMPTS, PARAMS, use_tqdm=False))

        def takes_a_cached_prefix(out) -> bool:
            return any(
                group.is_prefill() and seq.data.get_num_computed_tokens() > 0
                for group in out.scheduled_seq_groups
                for seq in group.get_unfinished_seqs()
            )

        with kill_before_a_step(llm, 1, takes_a_cached_prefix, 0.5) as fired:
            with caplog.at_level("INFO", logger="vllm"):
                outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert fired, "no prompt took a prefix from the cache"
        assert outputs_of(outputs) == reference
        (event,) = llm.llm_engine.fault_events
        extra = event.as_dict()
        assert extra["stage_recovery"] == "local", extra
        assert "the KV it had was rebuilt and stays in the prefix cache" in caplog.text
        assert extra["recomputed_tokens"] == extra["replayed_tokens"], extra
        assert_work_is_the_rebuilt_share(extra, 2)
    finally:
        llm.shutdown()
