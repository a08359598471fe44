"""Stage liveness: the errors a failed stage raises, how a stage is named in them, the state
of a stage process on this node (/proc), and the diagnosis that tells a dead or frozen stage
from one that is only waiting on its neighbour (`diagnose`, `name_failures`: the decisions; the
executors only gather the facts -- `stage_watch` keeps them: heartbeats answered by a thread of
each rank process, and this node's processes read from /proc).

A stage is a replaceable process: it holds weights (reloadable) and the KV cache of its layers
(lost with it). The executor waits for every micro-batch against a deadline, and the stage
watch fails the wait at once when a stage process is gone or stopped, or has left a heartbeat
unanswered for VLLM_PP_HEARTBEAT_TIMEOUT_S (a step of any length keeps answering them).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from vllm import envs
from vllm.worker.stage_report import StageInfo


def heartbeat_timeout_s() -> float:
    """How long a stage may leave a heartbeat unanswered before it counts as frozen (s)."""
    return envs.get_float("VLLM_PP_HEARTBEAT_TIMEOUT_S")


def heartbeat_interval_s() -> float:
    """How often the engine probes each stage's heartbeat thread and this node's processes."""
    return envs.get_float("VLLM_PP_HEARTBEAT_INTERVAL_S")


@dataclass
class StageFailure:
    """One failed stage: its rank, how it was described, and what was seen."""

    rank: int
    description: str
    problem: str


class StageFailedError(RuntimeError):
    """One or more pipeline stages died, froze or raised while running a step.

    `failures` names each stage (rank, layers, node, pid) and what was seen; `__cause__` is the
    underlying error when there is one (Ray's ActorDiedError, a gloo error, a timeout).
    `detected_after_s`: when the stage watch found it, from the start of the trouble as far
    as the watch can tell (the last process check that found it well, or the first heartbeat
    it left unanswered: within an interval of the fault); else the failed wait's length."""

    def __init__(
        self,
        failures: list[StageFailure],
        detected_after_s: float,
        call_id: int | None = None,
    ) -> None:
        self.failures = failures
        self.detected_after_s = detected_after_s
        # The engine's call (a step) a stage raised in, when one did: which requests it held.
        self.call_id = call_id
        lines = "; ".join(f"{f.description}: {f.problem}" for f in failures)
        super().__init__(f"pipeline stage failure after {detected_after_s:.1f} s: {lines}")

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    @property
    def raised_signature(self) -> tuple[tuple[int, str], ...] | None:
        """(rank, first line of the error) of each failed stage when every one of them raised
        an exception (not died, froze or missed a deadline): the same signature again after a
        replacement means a failure that replaying the step will only repeat."""
        if not self.failures or not all(f.problem.startswith("raised ") for f in self.failures):
            return None
        return tuple((f.rank, f.problem.splitlines()[0]) for f in self.failures)


class EngineDeadError(RuntimeError):
    """The engine cannot run any more (a stage failed and could not be replaced, or the
    restarts allowed by max_stage_restarts are used up). Every unfinished request was aborted
    and the workers released; build a new LLM / LLMEngine to go on."""


@dataclass
class EngineHealth:
    """What `/health` reports of a live engine: "healthy", or "degraded" while a failed stage
    is being replaced (or was found failed and will be at the next step) -- requests are
    accepted and finish once it is back. A dead engine raises instead (503)."""

    status: str = "healthy"
    message: str = ""
    ranks: list[int] = field(default_factory=list)

    @property
    def degraded(self) -> bool:
        return self.status == "degraded"


@dataclass
class FaultEvent:
    """One stage failure the engine survived (or not): for logs, masstest and tests."""

    ranks: list[int]
    message: str
    detected_after_s: float
    recovery_s: float | None = None
    requeued_requests: int = 0
    # When the engine learned of the failure (time.time()).
    detected_at: float = field(default_factory=time.time)
    # What StageFailedError.raised_signature said, and the requests of the step that failed.
    signature: tuple[tuple[int, str], ...] | None = None
    step_request_ids: list[str] = field(default_factory=list)
    # The same failure again on the same requests after a replacement: those requests were
    # failed instead of replayed, and the replacement was not counted as a restart.
    recurring: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of the process `pid` on this node, None once it is gone.

    Read from /proc/<pid>/stat where it exists (one small read: exact and instant, so it can
    run every quarter second): 'T' stopped (SIGSTOP), 't' stopped by a tracer, 'Z' exited
    but not reaped, 'X' dead. The start time (clock ticks since boot) tells a reused pid from
    the process first seen. Elsewhere psutil answers (start time 0: not compared)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            data = stat.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None  # /proc exists and the process does not
        return _psutil_state(pid)
    except ProcessLookupError:
        return None
    # The name field may hold spaces and parentheses: the fields after it follow its last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


def _psutil_state(pid: int) -> tuple[str, int] | None:
    import psutil

    letters = {psutil.STATUS_STOPPED: "T", psutil.STATUS_ZOMBIE: "Z", psutil.STATUS_DEAD: "X"}
    try:
        return letters.get(psutil.Process(pid).status(), "S"), 0
    except psutil.NoSuchProcess:
        return None


def is_local(host: str | None) -> bool:
    """Whether a stage reported `host` runs on this node (its process can be looked at)."""
    return host is not None and host == socket.gethostname()


def local_process_problem(
    pid: int | None, host: str | None, start_time: int | None = None
) -> str | None:
    """What is wrong with the stage's process, if it runs on this node and something is
    (`start_time`: the one it had when first seen, to tell a reused pid)."""
    if pid is None or not is_local(host):
        return None
    state = process_state(pid)
    if state is None:
        return f"process {pid} exited (it no longer exists)"
    letter, started = state
    if start_time and started and started != start_time:
        return f"process {pid} exited (its pid now belongs to another process)"
    if letter in ("T", "t"):
        return f"process {pid} is stopped (SIGSTOP?)"
    if letter in ("Z", "X"):
        return f"process {pid} exited (zombie)"
    return None


def kill_local_process(pid: int | None, host: str | None) -> None:
    """SIGKILL the stage's process when it runs on this node (frozen ones ignore anything
    gentler); a no-op for processes elsewhere or already gone."""
    if pid is None or not is_local(host) or pid == os.getpid():
        return
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_process_gone(pid: int | None, host: str | None, timeout_s: float) -> bool:
    """True once the local process `pid` has exited (True at once for remote ones)."""
    if pid is None or not is_local(host):
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = process_state(pid)
        if state is None or state[0] in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@dataclass
class PingAnswer:
    """What one stage's heartbeat said last (None in `diagnose`: no answer in time)."""

    died: str | None = None  # the stage is gone (what was seen), else None
    busy_s: float | None = None  # seconds in the step in progress, None between steps


def local_problems(infos: list[StageInfo]) -> dict[int, str]:
    """rank -> what is wrong with its process, for the stages on this node (certain at once:
    no heartbeat needs to run out on a frozen one)."""
    return {
        rank: problem
        for rank, info in enumerate(infos)
        if (problem := local_process_problem(info.pid, info.host))
    }


def diagnose(
    infos: list[StageInfo],
    answers: dict[int, PingAnswer | None],
    waited_s: float,
    heartbeat_timeout: float,
    include_stuck: bool = True,
) -> dict[int, str]:
    """rank -> problem for every stage that is dead or frozen (no answer, its actor gone, its
    process gone or stopped), else -- with `include_stuck` -- the stages stuck in one step for
    longer than the wait. A stage stuck in a receive from a dead one is a victim, not a cause,
    so it is named only when nothing is dead."""
    problems: dict[int, str] = {}
    stuck: dict[int, str] = {}
    for rank, answer in answers.items():
        info = infos[rank]
        local = local_process_problem(info.pid, info.host)
        if answer is None:
            problems[rank] = local or (
                f"did not answer a heartbeat within {heartbeat_timeout:g} s (frozen?)"
            )
        elif answer.died is not None:
            problems[rank] = local or f"died ({answer.died})"
        elif local:
            problems[rank] = local
        elif answer.busy_s is not None and answer.busy_s >= waited_s > 0:
            stuck[rank] = f"stuck in one step for {answer.busy_s:.1f} s"
    return problems or (stuck if include_stuck else {})


def name_failures(
    infos: list[StageInfo],
    problems: dict[int, str],
    waited_s: float,
    raised: tuple[int, str, int | None] | None = None,
    timeout_problem: str | None = None,
) -> StageFailedError:
    """The error for the engine: the diagnosed stages; else the one that raised (`raised`:
    its rank, the error text with its traceback, the call it raised in); else every stage,
    with `timeout_problem` (a missed deadline with every stage alive)."""
    call_id = None
    if not problems and raised is not None:
        rank, text, call_id = raised
        # The error's first line, then the end of its traceback (where it was raised).
        head, _, trace = text.strip().partition("\n")
        problems = {rank: head[:500] + (f"\n{trace[-500:]}" if trace else "")}
    if not problems:
        problems = {rank: timeout_problem or "failed" for rank in range(len(infos))}
    failures = [
        StageFailure(rank, infos[rank].describe(), problem)
        for rank, problem in sorted(problems.items())
    ]
    return StageFailedError(failures, waited_s, call_id)
