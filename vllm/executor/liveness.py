"""Stage liveness: the state of a stage process on this node (/proc), and the diagnosis that
tells a dead or frozen stage from one that is only waiting on its neighbour (`diagnose`, and
`name_failures`, which names them in a StageFailedError: the decisions; the executors only
gather the facts -- the supervisor, `vllm.executor.supervisor`, keeps them: heartbeats answered
by a thread of each rank process, and this node's processes read from /proc).

A stage is a replaceable process: it holds weights (reloadable) and the KV cache of its layers
(lost with it). The executor waits for every micro-batch against a deadline, and the
supervisor fails the wait at once when a stage process is gone or stopped, or has left a
heartbeat unanswered for VLLM_PP_HEARTBEAT_TIMEOUT_S (a step of any length keeps answering).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from vllm import envs
from vllm.resilience.errors import StageFailedError, StageFailure
from vllm.worker.stage_report import StageInfo


def heartbeat_timeout_s() -> float:
    """How long a stage may leave a heartbeat unanswered before it counts as frozen (s)."""
    return envs.get_float("VLLM_PP_HEARTBEAT_TIMEOUT_S")


def heartbeat_interval_s() -> float:
    """How often the engine probes each stage's heartbeat thread and this node's processes."""
    return envs.get_float("VLLM_PP_HEARTBEAT_INTERVAL_S")


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
