"""The stage supervisor (`vllm.executor.supervisor`) against rank ends served on threads of this
process and real child processes: a silent heartbeat is reported within the timeout (only
once armed) and withdrawn when answers resume; a rank whose step keeps its thread busy keeps
answering; a stopped, exited or reused-pid process is reported from /proc within an interval,
whatever the timeout. Torch-free."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from vllm.executor.liveness import local_process_problem, process_state
from vllm.executor.supervisor import StageSupervisor
from vllm.worker.rank_server import HEARTBEAT_ANSWER, HEARTBEAT_PROBE, answer_heartbeats

pytestmark = pytest.mark.fast

INTERVAL, TIMEOUT = 0.05, 0.6
HOST = socket.gethostname()


class Reports:
    """What the watch reported, with the time of each report."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, int, str | None]] = []
        self.since: dict[int, float] = {}  # rank -> when its trouble began, as last reported
        self.cond = threading.Condition()

    def __call__(self, rank: int, problem: str | None, since: float) -> None:
        assert since <= time.monotonic()
        with self.cond:
            self.since[rank] = since
            self.seen.append((time.monotonic(), rank, problem))
            self.cond.notify_all()

    def wait(self, test, timeout: float = 10.0) -> tuple[float, int, str | None]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for entry in self.seen:
                    if test(entry):
                        return entry
                left = deadline - time.monotonic()
                assert left > 0, f"not reported: {self.seen}"
                self.cond.wait(left)


class PausableRank:
    """A rank's heartbeat end on a thread that can stop answering (as if frozen)."""

    def __init__(self) -> None:
        self.engine_end, self.rank_end = multiprocessing.Pipe(duplex=True)
        self.answering = threading.Event()
        self.answering.set()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                (seq,) = HEARTBEAT_PROBE.unpack(self.rank_end.recv_bytes())
            except (EOFError, OSError):
                return
            self.answering.wait()
            try:
                self.rank_end.send_bytes(HEARTBEAT_ANSWER.pack(seq, -1.0))
            except OSError:
                return


@pytest.fixture
def watch():
    reports = Reports()
    w = StageSupervisor(2, reports, interval_s=INTERVAL, timeout_s=TIMEOUT)
    yield w, reports
    w.close()


def test_a_silent_rank_is_reported_within_the_timeout_and_withdrawn_when_it_answers(watch):
    w, reports = watch
    ranks = [PausableRank(), PausableRank()]
    for rank, r in enumerate(ranks):
        w.attach(rank, r.engine_end, None, None)
    w.arm()
    time.sleep(5 * INTERVAL)
    assert not reports.seen and w.answers() == {0: w.answers()[0], 1: w.answers()[1]}
    ranks[1].answering.clear()
    silent_from = time.monotonic()
    at, rank, problem = reports.wait(lambda e: e[2] is not None)
    assert rank == 1 and "did not answer a heartbeat" in problem, problem
    assert TIMEOUT - INTERVAL <= at - silent_from <= TIMEOUT + 1.5
    # The fault's time as the engine will state it: within an interval of the silence.
    assert abs(reports.since[1] - silent_from) <= INTERVAL + 0.3
    assert w.problems() == {1: problem} and w.answers()[1] is None
    time.sleep(4 * INTERVAL)
    assert [e for e in reports.seen if e[2]] == [(at, rank, problem)]  # reported once
    ranks[1].answering.set()
    reports.wait(lambda e: e[1] == 1 and e[2] is None)
    assert w.problems() == {}
    assert all(s.answered > 0 and s.max_s < TIMEOUT for s in w.stats() if s.rank == 0)


def test_a_renumbered_rank_is_reported_under_its_new_number(watch):
    """Stage 0 left (`renumber`): old rank 1 is rank 0 now, and its silence says so."""
    w, reports = watch
    ranks = [PausableRank(), PausableRank()]
    for rank, r in enumerate(ranks):
        w.attach(rank, r.engine_end, None, None)
    w.arm()
    w.detach(0)
    w.renumber([1])
    ranks[1].answering.clear()
    _, rank, problem = reports.wait(lambda e: e[2] is not None)
    assert rank == 0 and "heartbeat" in problem
    assert w.problems() == {0: problem}


def test_an_unarmed_rank_may_be_silent(watch):
    """Before its set-up is over a rank may hold its GIL for long (importing torch): not
    reported; armed, its silence counts from then."""
    w, reports = watch
    rank = PausableRank()
    rank.answering.clear()
    w.attach(0, rank.engine_end, None, None)
    time.sleep(TIMEOUT + 5 * INTERVAL)
    assert not reports.seen
    armed_at = time.monotonic()
    w.arm([0])
    at, _, problem = reports.wait(lambda e: e[2] is not None)
    assert at - armed_at >= TIMEOUT - INTERVAL and "heartbeat" in problem


def test_a_busy_step_keeps_the_heartbeat_answered():
    """The rank's heartbeat thread answers while another thread of its process computes
    (pure Python here, the GIL's worst case: it is handed over every 5 ms), for twice the
    default timeout, which applies here."""
    reports = Reports()
    w = StageSupervisor(1, reports, interval_s=0.25)
    try:
        engine_end, rank_end = multiprocessing.Pipe(duplex=True)
        started = time.perf_counter()
        threading.Thread(
            target=answer_heartbeats,
            args=(rank_end, lambda: time.perf_counter() - started),
            daemon=True,
        ).start()
        w.attach(0, engine_end, None, None)
        w.arm()
        spin_until = time.monotonic() + 2 * w.timeout_s
        while time.monotonic() < spin_until:
            sum(range(1000))
        assert not reports.seen
        stats = w.stats()[0]
        print(f"round trips while a thread computes: {stats}")
        assert stats.answered >= 8 and stats.max_s < w.timeout_s, stats
        answer = w.answers()[0]
        assert answer is not None and answer.busy_s is not None and answer.busy_s > w.timeout_s
    finally:
        w.close()


def test_process_states_from_proc(watch):
    """Stopped, continued, exited: from /proc within an interval, with no heartbeat at all
    (the timeout plays no part)."""
    w, reports = watch
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        w.attach(0, None, child.pid, HOST)
        w.arm()
        time.sleep(3 * INTERVAL)
        assert not reports.seen
        os.kill(child.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        at, _, problem = reports.wait(lambda e: e[2] is not None)
        assert problem == f"process {child.pid} is stopped (SIGSTOP?)"
        assert stopped - INTERVAL - 0.3 <= reports.since[0] <= stopped
        assert at - stopped < 5 * INTERVAL + 0.3
        os.kill(child.pid, signal.SIGCONT)
        reports.wait(lambda e: e[2] is None)
        child.kill()
        at, _, problem = reports.wait(lambda e: e[2] is not None and "exited" in e[2])
        assert problem in (
            f"process {child.pid} exited (zombie)",
            f"process {child.pid} exited (it no longer exists)",
        )
    finally:
        child.kill()
        child.wait()


def test_proc_reading():
    state = process_state(os.getpid())
    assert state is not None and state[0] in "RS" and state[1] > 0
    # A process started at another time under the same pid is not the one first seen.
    problem = local_process_problem(os.getpid(), HOST, start_time=state[1] + 1)
    assert problem == f"process {os.getpid()} exited (its pid now belongs to another process)"
    assert local_process_problem(os.getpid(), HOST, start_time=state[1]) is None
    assert local_process_problem(os.getpid(), "another-node") is None  # not ours to read


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="VLLM_PP_HEARTBEAT_INTERVAL_S"):
        StageSupervisor(1, lambda rank, problem, since: None, interval_s=1.0, timeout_s=0.5)
