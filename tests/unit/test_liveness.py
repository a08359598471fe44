"""The supervisor's decisions from gathered facts (pings, errors): which stages failed and how
the engine's error names them. Torch-free, no processes."""

from __future__ import annotations

import pytest

from vllm.executor.liveness import PingAnswer, diagnose, name_failures
from vllm.worker.stage_report import StageInfo

pytestmark = pytest.mark.fast


def _infos(n: int = 3) -> list[StageInfo]:
    # Another host: the checks of this node's processes stay out of the way.
    return [
        StageInfo(r, r, layers=(2 * r, 2 * r + 2), host="elsewhere", ip="10.0.0.9", pid=100 + r)
        for r in range(n)
    ]


def test_a_silent_stage_is_named_and_the_ones_waiting_on_it_are_not():
    answers = {0: PingAnswer(busy_s=9.0), 1: None, 2: PingAnswer(busy_s=9.0)}
    problems = diagnose(_infos(), answers, waited_s=5.0, heartbeat_timeout=3.0)
    assert problems == {1: "did not answer a heartbeat within 3 s (frozen?)"}


def test_a_dead_actor_is_named():
    answers = {0: PingAnswer(), 1: PingAnswer(died="connection closed"), 2: PingAnswer()}
    assert diagnose(_infos(), answers, 1.0, 3.0) == {1: "died (connection closed)"}


def test_stuck_stages_only_when_nothing_is_dead_and_asked_for():
    answers = {0: PingAnswer(busy_s=0.1), 1: PingAnswer(busy_s=61.0), 2: PingAnswer()}
    assert diagnose(_infos(), answers, 60.0, 3.0) == {1: "stuck in one step for 61.0 s"}
    assert diagnose(_infos(), answers, 60.0, 3.0, include_stuck=False) == {}


def test_the_error_names_the_stage_that_raised_with_the_end_of_its_traceback():
    text = "ValueError: bad\nTraceback (most recent call last):\n  File x, line 3\nValueError: bad"
    error = name_failures(_infos(), {}, 0.2, raised=(2, text, 17))
    assert error.ranks == [2] and error.call_id == 17
    assert "stage 2 (rank 2, layers [4, 6), node elsewhere 10.0.0.9, pid 102): ValueError: bad" in (
        str(error)
    )
    assert error.failures[0].problem.endswith("ValueError: bad")


def test_a_missed_deadline_with_every_stage_alive_names_them_all():
    error = name_failures(_infos(2), {}, 61.0, timeout_problem="missed the 61 s step deadline")
    assert error.ranks == [0, 1] and error.call_id is None
    assert all(f.problem == "missed the 61 s step deadline" for f in error.failures)
    # Diagnosed problems win over the error and the deadline.
    error = name_failures(_infos(2), {0: "actor died (X)"}, 1.0, (1, "E: x", 3), "deadline")
    assert error.ranks == [0] and error.call_id is None
