"""vLLM's concurrent partial prefills in the chunked policy (no model, no torch):
`max_num_partial_prefills` N prompts share a step's token budget, `max_long_partial_prefills`
of them may be long so shorter prompts are admitted past a waiting long one; at the defaults
the schedule is exactly the frozen reference's; vLLM's config rules, messages and CLI flags."""

from __future__ import annotations

import argparse
import functools

import pytest

import tests.unit.test_scheduler_differential as differential
from tests.utils.fake_requests import FakeParams as _Params
from tests.utils.fake_requests import seq_ids as _seq_ids
from tests.utils.stage_view import schedule_rows
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.budget import MicroBatchBudget
from vllm.core.scheduler import Scheduler
from vllm.engine.arg_utils import EngineArgs
from vllm.sequence import Sequence, SequenceGroup

pytestmark = pytest.mark.fast


def _scheduler(budget: int, partial: int, long: int, cohorts: int = 1) -> Scheduler:
    cache = CacheConfig(block_size=4, num_gpu_blocks=128, num_cpu_blocks=8)
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        max_model_len=256,  # long_prefill_token_threshold: int(256 * 0.04) = 10
        enable_chunked_prefill=True,
        max_num_partial_prefills=partial,
        max_long_partial_prefills=long,
    )
    return Scheduler(config, cache, MicroBatchBudget.from_config(config, cohorts))


def _add(sched: Scheduler, rid: str, prompt_len: int, arrival: float) -> SequenceGroup:
    seq = Sequence(next(_seq_ids), "p", list(range(prompt_len)), block_size=4)
    group = SequenceGroup(rid, [seq], _Params(), arrival_time=arrival)
    sched.add_seq_group(group)
    return group


def _step(sched: Scheduler) -> list[tuple[str, int, bool]]:
    """One step, returned at once (as PP=1 does): (request, tokens, samples) per row."""
    rows, _ = schedule_rows(sched)
    groups = [sched.in_flight[m.request_id] for m in rows]
    sched.finish_in_flight([m.request_id for m in rows])
    for meta, group in zip(rows, groups):
        if meta.do_sample:
            for seq_id in meta.seq_data:
                group.find(seq_id).data.append_token_id(7, 0.0)
    return [(m.request_id, m.token_chunk_size, m.do_sample) for m in rows]


def test_two_prompts_prefill_in_one_step_sharing_the_budget() -> None:
    sched = _scheduler(budget=32, partial=2, long=2)
    _add(sched, "a", 100, arrival=0.0)
    _add(sched, "b", 100, arrival=1.0)
    # Both long (100 > 10), both allowed: each takes half of the budget (at N = 1 "a" would
    # take all 32 tokens and "b" would wait).
    assert _step(sched) == [("a", 16, False), ("b", 16, False)]
    assert _step(sched) == [("a", 16, False), ("b", 16, False)]
    # A third prompt arriving now: two prefills are running already, the split stays 2.
    _add(sched, "c", 4, arrival=2.0)
    assert _step(sched) == [("a", 16, False), ("b", 16, False)]


def test_a_short_prompt_is_admitted_past_a_long_one() -> None:
    sched = _scheduler(budget=32, partial=2, long=1)
    long1 = _add(sched, "long1", 100, arrival=0.0)
    _add(sched, "long2", 100, arrival=1.0)
    _add(sched, "short", 6, arrival=2.0)
    # long1 runs; long2 would be a second long prefill: it is passed over, keeping its place,
    # and the short prompt behind it gets the other share and its first token.
    assert _step(sched) == [("long1", 16, False), ("short", 6, True)]
    assert [g.request_id for g in sched.waiting] == ["long2"]
    steps: list[list[tuple[str, int, bool]]] = []
    while not steps or "long2" not in [r[0] for r in steps[-1]]:
        seq = long1.get_seqs()[0]
        left = seq.get_num_new_tokens() if seq.is_prefill() else 0
        steps.append(_step(sched))
        # long2 waits while long1 has more than the threshold (10 tokens) left to prefill.
        assert ("long2" in [r[0] for r in steps[-1]]) == (left <= 10), (left, steps)
    # long2, held back, takes no share: long1 has the budget the short decode leaves.
    assert steps[0] == [("long1", 31, False), ("short", 1, True)]
    assert not sched.waiting and not long1.is_prefill()


def test_at_n1_a_long_prompt_holds_back_the_short_one() -> None:
    """The same queue at the defaults: first come, first served (vLLM's N = 1)."""
    sched = _scheduler(budget=32, partial=1, long=1)
    _add(sched, "long1", 100, arrival=0.0)
    _add(sched, "long2", 100, arrival=1.0)
    _add(sched, "short", 6, arrival=2.0)
    assert _step(sched) == [("long1", 32, False)]
    assert [g.request_id for g in sched.waiting] == ["long2", "short"]


def test_pipelined_micro_batches_share_their_budget() -> None:
    """With two cohorts the split is of each micro-batch's budget, and a long prompt whose
    chunks are in flight still counts as the long one running."""
    sched = _scheduler(budget=64, partial=2, long=1, cohorts=2)
    _add(sched, "long1", 200, arrival=0.0)
    _add(sched, "long2", 200, arrival=1.0)
    _add(sched, "short", 6, arrival=2.0)
    # Each micro-batch's budget: half of the round's 64 prompt tokens; long1 and short split it.
    first, _ = schedule_rows(sched, step_no=1)
    assert [(m.request_id, m.token_chunk_size) for m in first] == [("long1", 16), ("short", 6)]
    # long1's next chunk follows the one in flight, alone now: long2 is still held back.
    second, _ = schedule_rows(sched, step_no=2)
    assert [(m.request_id, m.token_chunk_size) for m in second] == [("long1", 32)]
    assert [g.request_id for g in sched.waiting] == ["long2"]


def _with_knobs(monkeypatch: pytest.MonkeyPatch, **knobs: int) -> None:
    """Build the differential driver's scheduler configs with `knobs`."""
    monkeypatch.setattr(
        differential, "SchedulerConfig", functools.partial(SchedulerConfig, **knobs)
    )


# Chunked workloads of the differential test (a few milliseconds to a second each).
CHUNKED_SEEDS = [s for s in range(60) if differential.draw_workload(s).chunked][:8]


def test_defaults_schedule_exactly_as_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """N = 1 (set explicitly) decides every step as the frozen reference scheduler, on random
    chunked workloads (preemption, prefix caching, PP cohorts, aborts, stage failures)."""
    _with_knobs(monkeypatch, max_num_partial_prefills=1, max_long_partial_prefills=1)
    calls = sum(differential.run_workload(seed) for seed in CHUNKED_SEEDS)
    assert calls > 20 * len(CHUNKED_SEEDS)


def _run_alone(w: differential.Workload) -> bool:
    """Drive the live scheduler alone through `w`'s arrivals until every request finished;
    False if the workload ran out of swap space (vLLM's RuntimeError, a valid outcome)."""
    live = differential.Side(w, reference=False)
    for step in range(2000):
        for request in w.requests:
            if request.arrives == step:
                live.add(request)
        while len(live.batches) < live.max_batches:
            try:
                metadata, out = live.schedule()
            except RuntimeError as error:
                assert "swap space" in str(error)
                return False
            if out.is_empty():
                break
            # Within the step's tokens (a lone group of several samples always fits).
            assert out.num_batched_tokens <= w.max_num_batched_tokens or len(metadata) == 1
            live.submit(out, metadata)
        if live.batches:
            live.collect()
        elif step > 30 and not live.scheduler.has_unfinished_seqs():
            return True
    raise AssertionError("requests left unfinished")


def test_n2_schedules_differently_and_every_request_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """N = 2 is wired: some workloads diverge from the reference; run alone, every request
    of every workload finishes within the budget (no hang, no lost prompt)."""
    _with_knobs(monkeypatch, max_num_partial_prefills=2, max_long_partial_prefills=1)
    diverged = []
    for seed in CHUNKED_SEEDS:
        try:
            differential.run_workload(seed)
        except AssertionError:
            diverged.append(seed)
    assert diverged
    finished = 0
    for seed in CHUNKED_SEEDS:
        w = differential.draw_workload(seed)
        w.events.clear()  # arrivals only
        finished += _run_alone(w)
    assert finished >= len(CHUNKED_SEEDS) // 2


def test_config_rules_defaults_and_cli_flags() -> None:
    # vLLM's default threshold with several partial prefills: 4% of max_model_len, which
    # only tells long prompts from short ones (no per-step cap).
    config = SchedulerConfig(
        max_model_len=2048, enable_chunked_prefill=True, max_num_partial_prefills=2
    )
    assert config.long_prefill_token_threshold == 81 and config.prefill_token_cap == 0
    explicit = SchedulerConfig(
        enable_chunked_prefill=True, max_num_partial_prefills=2, long_prefill_token_threshold=64
    )
    assert explicit.long_prefill_token_threshold == 64 == explicit.prefill_token_cap
    assert SchedulerConfig().long_prefill_token_threshold == 0
    with pytest.raises(
        ValueError, match=r"^Chunked prefill must be enabled to set max_num_partial_prefills > 1\.$"
    ):
        SchedulerConfig(max_num_partial_prefills=2)
    with pytest.raises(
        ValueError,
        match=r"^max_long_partial_prefills \(3\) must be greater than or equal to 1 and less than "
        r"or equal to max_num_partial_prefills \(2\)\.$",
    ):
        SchedulerConfig(
            enable_chunked_prefill=True, max_num_partial_prefills=2, max_long_partial_prefills=3
        )
    with pytest.raises(ValueError, match=r"max_long_partial_prefills \(0\) must be greater"):
        SchedulerConfig(max_long_partial_prefills=0)
    with pytest.raises(
        ValueError, match=r"^max_num_partial_prefills \(0\) must be greater than or equal to 1\.$"
    ):
        SchedulerConfig(max_num_partial_prefills=0)
    with pytest.raises(
        ValueError,
        match=r"^long_prefill_token_threshold \(300\) cannot be greater than the max_model_len "
        r"\(256\)\.$",
    ):
        SchedulerConfig(
            max_model_len=256,
            enable_chunked_prefill=True,
            max_num_partial_prefills=2,
            long_prefill_token_threshold=300,
        )
    with pytest.raises(TypeError, match="max_num_partial_prefills must be an int"):
        SchedulerConfig(max_num_partial_prefills=2.0)  # type: ignore[arg-type]
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(
        parser.parse_args(["--max-num-partial-prefills", "4", "--max-long-partial-prefills", "2"])
    )
    assert (args.max_num_partial_prefills, args.max_long_partial_prefills) == (4, 2)
    defaults = EngineArgs.from_cli_args(parser.parse_args([]))
    assert (defaults.max_num_partial_prefills, defaults.max_long_partial_prefills) == (1, 1)
