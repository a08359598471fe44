"""An elastic pipeline: the decoder layers re-split over the same stages while requests are in
flight (`LLMEngine.reshape_pipeline`, and automatically from the stages' compute times), on
the mp and Ray backends at PP = 2 and 3. Every request finishes with exactly the greedy and
seeded outputs of a run without the re-split; a bad split is a ValueError naming
`layer_split` that changes nothing; a stage replaced after a re-split loads its new range."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from tests.utils import tiny_models
from tests.utils.faults import (
    after_steps,
    engine_with_reference,
    gone,
    greedy_and_seeded,
    step_with_actions,
    token_ids,
)
from vllm import LLM
from vllm.distributed.layer_split import rebalanced_layer_sizes
from vllm.resilience.plans import reshape
from vllm.worker.stage_report import StageStats

PROMPTS = tiny_models.PROMPTS * 2
# Half greedy, half seeded random: both must come out exactly as without a re-split.
PARAMS = greedy_and_seeded(len(PROMPTS))
# Two re-splits per PP size, both away from the even split and from each other.
SPLITS = {2: ([1, 5], [4, 2]), 3: ([1, 1, 4], [3, 2, 1])}

ENGINES = [
    pytest.param(("mp", 2), id="mp-pp2"),
    pytest.param(("mp", 3), id="mp-pp3"),
    pytest.param(("ray", 2), id="ray-pp2", marks=pytest.mark.ray),
    pytest.param(("ray", 3), id="ray-pp3", marks=pytest.mark.ray),
]


@pytest.fixture(scope="module", params=ENGINES)
def elastic(request, tiny_model_dirs):
    """An engine and the outputs of PARAMS on it before any re-split."""
    yield from engine_with_reference(request, tiny_model_dirs["llama-gqa-tied"], PROMPTS, PARAMS)


def layers_of(llm: LLM) -> list[tuple[int, int] | None]:
    return [info.layers for info in llm.llm_engine.get_stage_infos()]


def ranges(split: list[int]) -> list[tuple[int, int]]:
    return [(sum(split[:i]), sum(split[: i + 1])) for i in range(len(split))]


def assert_engine_idle(llm: LLM) -> None:
    scheduler = llm.llm_engine.scheduler
    assert not scheduler.in_flight and not scheduler.has_unfinished_seqs()
    manager = scheduler.block_manager
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks


def test_resplit_with_requests_in_flight_keeps_every_output(elastic):
    llm, reference = elastic
    engine = llm.llm_engine
    pp = engine.parallel_config.pipeline_parallel_size
    first, second = SPLITS[pp]
    events = []
    outputs = step_with_actions(
        llm,
        PROMPTS,
        PARAMS,
        {
            3: lambda: events.append(engine.reshape_pipeline(first)),
            9: lambda: events.append(engine.reshape_pipeline(second)),
        },
    )
    assert outputs == reference
    assert [e.new_split for e in events] == [first, second]
    assert all(e.recomputed_requests > 0 for e in events)
    assert events[0].old_split == tiny_models_even(pp)
    assert layers_of(llm) == ranges(second)
    assert engine.resilience.reshaper.current_split() == second
    # The block manager took the new minimum over stages.
    assert engine.scheduler.block_manager.num_total_gpu_blocks == events[-1].num_gpu_blocks
    assert_engine_idle(llm)
    # Later runs on the new split still equal the reference; back to the even split.
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference
    engine.reshape_pipeline(tiny_models_even(pp))
    assert layers_of(llm) == ranges(tiny_models_even(pp))


def tiny_models_even(pp: int) -> list[int]:
    return [6 // pp] * pp


def test_bad_layer_split_is_refused_and_changes_nothing(elastic):
    llm, reference = elastic
    engine = llm.llm_engine
    pp = engine.parallel_config.pipeline_parallel_size
    before = layers_of(llm)
    bad = [[6], [0] + [6 // (pp - 1)] * (pp - 1), [2] * pp + [0], [7] + [1] * (pp - 1), "3,3"]
    bad += [[3.0] * pp, [True] * pp]
    for split in bad:
        with pytest.raises(ValueError, match="^layer_split "):
            engine.reshape_pipeline(split)
    assert layers_of(llm) == before
    # The split it has already: nothing to do (no recompute).
    done = len(engine.resilience.reshaper.events)
    event = engine.reshape_pipeline(tiny_models_even(pp))
    assert event.recomputed_requests == 0 and len(engine.resilience.reshaper.events) == done
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference


def test_a_stage_replaced_after_a_resplit_loads_its_new_range(elastic):
    llm, reference = elastic
    engine = llm.llm_engine
    pp = engine.parallel_config.pipeline_parallel_size
    split = SPLITS[pp][0]
    engine.reshape_pipeline(split)
    victim: list[int] = []
    rank = pp - 1
    pid = engine.get_stage_infos()[rank].pid

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)
        victim.append(pid)

    faults = len(engine.fault_events)
    thread = after_steps(llm, 4, kill)
    outputs = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    thread.join(timeout=60)
    assert victim and gone(victim[0])
    assert len(engine.fault_events) == faults + 1
    assert outputs == reference
    infos = engine.get_stage_infos()
    assert infos[rank].pid != pid
    assert [info.layers for info in infos] == ranges(split)
    engine.reshape_pipeline(tiny_models_even(pp))
    assert_engine_idle(llm)


def fake_stats(engine, unit: list[float], head: float):
    """A get_stage_stats whose stage i takes `unit[i]` seconds per layer per step (the last
    stage's lm_head counted as `head` layers) under the engine's current split: 5 more steps
    at each call (fewer than a window needs: windows span calls), cumulative as with
    reset=False."""
    totals = [StageStats(pp_rank=i) for i in range(len(unit))]

    def get_stage_stats(reset: bool = True) -> list[StageStats]:
        split = engine.resilience.reshaper.current_split()
        for i, stats in enumerate(totals):
            units = split[i] + (head if i == len(unit) - 1 else 0.0)
            stats.steps += 5
            stats.compute_s += 5 * unit[i] * units
        return [dataclasses.replace(stats) for stats in totals]

    return get_stage_stats


def test_auto_resplit_moves_layers_off_the_slow_stage(elastic, monkeypatch):
    """The automatic re-split's decision on measured times (stage 0 slowed, as reported by
    the stages' stats), then a real re-split with requests in flight.
    (benchmarks/pp_rebalance.py slows a stage for real.)"""
    llm, reference = elastic
    engine = llm.llm_engine
    pp = engine.parallel_config.pipeline_parallel_size
    even = tiny_models_even(pp)
    assert engine.resilience.reshaper.current_split() == even
    head = engine.model_config.get_lm_head_cost_in_layers()
    # Stage 0 100x slower per layer (the tiny model's lm_head is worth ~85 of its layers,
    # so the last stage is slowest unless another is slowed that much).
    unit = [1.0] + [0.01] * (pp - 1)
    per_step = [
        u * (n + (head if i == pp - 1 else 0.0)) for i, (u, n) in enumerate(zip(unit, even))
    ]
    expected, measured, predicted = rebalanced_layer_sizes(even, per_step, head)
    assert expected[0] < even[0] and predicted < 0.9 * measured
    monkeypatch.setattr(reshape, "AUTO_INTERVAL_S", 0.0)
    monkeypatch.setattr(engine.executor, "get_stage_stats", fake_stats(engine, unit, head))
    monkeypatch.setattr(engine.resilience.reshaper, "auto", True)
    events = len(engine.resilience.reshaper.events)
    outputs = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert outputs == reference
    # One re-split: the stages' times afterwards show the split is the best one for them.
    new = engine.resilience.reshaper.events[events:]
    assert [e.reason for e in new] == ["auto"] and new[0].new_split == expected
    assert new[0].measured_step_s == pytest.approx(measured)
    assert new[0].predicted_step_s == pytest.approx(predicted)
    assert layers_of(llm) == ranges(expected)
    monkeypatch.undo()
    engine.reshape_pipeline(even)
    assert_engine_idle(llm)


def test_a_single_stage_has_only_its_own_split(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama-gqa-tied"], disable_log_stats=True)
    engine = llm.llm_engine
    try:
        event = engine.reshape_pipeline([6])
        assert event.new_split == [6] and event.recomputed_requests == 0
        with pytest.raises(ValueError, match="pipeline_parallel_size is 1"):
            engine.reshape_pipeline([3, 3])
        assert not engine.resilience.reshaper.auto  # nothing to balance with one stage
    finally:
        llm.shutdown()
