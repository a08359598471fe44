"""The engine's end of stage liveness: one thread that, every VLLM_PP_HEARTBEAT_INTERVAL_S
(0.25 s), reads the state of each stage process on this node from /proc and probes every
rank's heartbeat thread (`rank_server.answer_heartbeats`) over a connection of its own.

It runs whatever the engine does -- inside a step of any length, between steps, while idle --
so a stage is found as soon as it goes wrong, not when a step's wait gives up:
- a process on this node that is gone, a zombie or stopped (SIGSTOP) is certain at once
  (within one interval), whatever the heartbeat timeout;
- a rank anywhere (other Ray nodes too) that leaves a probe unanswered for
  VLLM_PP_HEARTBEAT_TIMEOUT_S is frozen. Probes go out every interval whether or not the
  previous one came back, so the oldest unanswered probe dates the silence to within an
  interval; answers are read before any probe is judged, so an engine thread that was itself
  held up never blames a rank for its own delay. The timeout applies to armed ranks only
  (after their set-up: importing torch or building a worker may hold a rank's GIL for long).

What it finds goes to `on_change(rank, problem or None, since)` at once (`since`, monotonic:
when the trouble began as far as the watch can tell -- the last check that found the process
well, or the first probe left unanswered -- so the engine can say how long after the fault it
knew, within an interval; the executor marks the rank
suspect in `RankCalls`, which fails the waits on it); a problem that clears (SIGCONT before
any step ran into it) is withdrawn the same way. Every answer's round trip is kept, the
figures behind the timeout's default (`stats`, `benchmarks/heartbeat_jitter.py`).
"""

from __future__ import annotations

import bisect
import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from vllm.executor.liveness import (
    PingAnswer,
    heartbeat_interval_s,
    heartbeat_timeout_s,
    local_process_problem,
    process_state,
)
from vllm.worker.rank_server import HEARTBEAT_ANSWER, HEARTBEAT_PROBE

_SILENT = "did not answer a heartbeat"
# Probes waiting for an answer, at most (a silent rank is declared long before this many).
_MAX_PENDING = 256


@dataclass
class _Rank:
    """What the watch knows of one rank."""

    conn: Connection | None
    pid: int | None
    host: str | None
    start_time: int | None = None
    armed: bool = False
    closed: bool = False
    next_seq: int = 0
    pending: deque[tuple[int, float]] = field(default_factory=deque)  # (seq, sent at)
    busy_s: float | None = None
    answered: int = 0
    # Round trips while armed (what the timeout is measured against), kept sorted.
    rtts: list[float] = field(default_factory=list)
    reported: str | None = None
    # monotonic() when the rank was last seen well (a check that found nothing wrong), or
    # once silent, when its first unanswered probe went out.
    last_ok: float = field(default_factory=time.monotonic)


@dataclass
class HeartbeatStats:
    """One rank's heartbeat round trips while armed, since it was attached (seconds)."""

    rank: int
    answered: int
    p50_s: float
    p99_s: float
    max_s: float


class StageSupervisor:
    """Liveness of every rank, on a thread of its own (see the module docstring)."""

    def __init__(
        self,
        world_size: int,
        on_change: Callable[[int, str | None, float], None],
        interval_s: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.interval_s = interval_s if interval_s is not None else heartbeat_interval_s()
        self.timeout_s = timeout_s if timeout_s is not None else heartbeat_timeout_s()
        if self.interval_s <= 0 or self.timeout_s <= self.interval_s:
            raise ValueError(
                "VLLM_PP_HEARTBEAT_INTERVAL_S must be > 0 and below VLLM_PP_HEARTBEAT_TIMEOUT_S, "
                f"got {self.interval_s:g} and {self.timeout_s:g}"
            )
        self._on_change = on_change
        self._lock = threading.Lock()
        self._ranks: list[_Rank | None] = [None] * world_size
        self._closing = False
        self._wake_recv, self._wake_send = multiprocessing.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm-stage-watch")
        self._thread.start()

    # ---- ranks ------------------------------------------------------------------------------

    def attach(self, rank: int, conn: Connection | None, pid: int | None, host: str | None) -> None:
        """Watch `rank` from now on: its heartbeat connection (None: no heartbeat, only its
        process) and its process (`pid` on `host`). Not armed yet."""
        with self._lock:
            old = self._ranks[rank]
            self._ranks[rank] = _Rank(conn, pid, host)
            if pid is not None and (state := process_state(pid)) is not None:
                self._ranks[rank].start_time = state[1]  # type: ignore[union-attr]
        if old is not None and old.conn is not None:
            old.conn.close()
        self._wake()

    def detach(self, rank: int) -> None:
        """Stop watching `rank` (its process is being killed); nothing more is reported."""
        with self._lock:
            old, self._ranks[rank] = self._ranks[rank], None
        if old is not None and old.conn is not None:
            old.conn.close()

    def renumber(self, order: list[int | None]) -> None:
        """The pipeline changed size: new rank i is old rank `order[i]` (None: an empty slot,
        attached later). Old ranks not in `order` must be detached first."""
        with self._lock:
            self._ranks = [None if old is None else self._ranks[old] for old in order]
        self._wake()

    def arm(self, ranks: list[int] | None = None, armed: bool = True) -> None:
        """Apply (or with `armed=False` lift) the heartbeat timeout on `ranks` (all: None).
        A rank's silence counts only from the probes sent after it was armed."""
        now = time.monotonic()
        with self._lock:
            for rank, entry in enumerate(self._ranks):
                if entry is not None and (ranks is None or rank in ranks):
                    entry.armed = armed
                    entry.pending = deque((seq, max(sent, now)) for seq, sent in entry.pending)

    def problems(self) -> dict[int, str]:
        """rank -> what is wrong with it now (as last reported)."""
        with self._lock:
            return {r: e.reported for r, e in enumerate(self._ranks) if e and e.reported}

    def answers(self) -> dict[int, PingAnswer | None]:
        """rank -> its last heartbeat (None: a probe unanswered past the timeout), for
        `liveness.diagnose`."""
        now = time.monotonic()
        out: dict[int, PingAnswer | None] = {}
        with self._lock:
            for rank, entry in enumerate(self._ranks):
                if entry is None or entry.conn is None:
                    continue
                if entry.closed:
                    out[rank] = PingAnswer(died="its heartbeat connection closed")
                elif entry.pending and now - entry.pending[0][1] > self.timeout_s:
                    out[rank] = None
                else:
                    out[rank] = PingAnswer(busy_s=entry.busy_s)
        return out

    def stats(self) -> list[HeartbeatStats]:
        """Round trips of the answers so far, per watched rank."""
        out = []
        with self._lock:
            for rank, entry in enumerate(self._ranks):
                if entry is None or not entry.rtts:
                    continue
                rtts = entry.rtts
                out.append(
                    HeartbeatStats(
                        rank,
                        entry.answered,
                        rtts[len(rtts) // 2],
                        rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))],
                        rtts[-1],
                    )
                )
        return out

    def close(self) -> None:
        self._closing = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)
        with self._lock:
            entries, self._ranks = self._ranks, [None] * len(self._ranks)
        for entry in entries:
            if entry is not None and entry.conn is not None:
                entry.conn.close()
        self._wake_send.close()
        self._wake_recv.close()

    def _wake(self) -> None:
        try:
            self._wake_send.send_bytes(b"")
        except OSError:
            pass

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._closing:
            with self._lock:
                conns = {e.conn: e for e in self._ranks if e and e.conn and not e.closed}
                # Wake when the oldest unanswered probe runs out too, not only at the next
                # tick: a silence is found within the timeout of its probe.
                expiries = [
                    e.pending[0][1] + self.timeout_s
                    for e in conns.values()
                    if e.armed and e.pending and e.reported is None
                ]
            wake_at = min([next_tick, *expiries])
            try:
                ready = wait([*conns, self._wake_recv], max(0.0, wake_at - time.monotonic()))
            except OSError:  # a connection closed under us: look again
                continue
            for obj in ready:
                if obj is self._wake_recv:
                    try:
                        self._wake_recv.recv_bytes()
                    except (EOFError, OSError):
                        return
                else:
                    self._read_answers(conns[obj])  # type: ignore[index]
            now = time.monotonic()
            if now >= next_tick:
                self._judge(conns, probe=True)
                next_tick = now + self.interval_s
            elif now >= wake_at:
                self._judge(conns, probe=False)

    def _read_answers(self, entry: _Rank) -> None:
        """Every answer waiting on `entry`'s connection."""
        conn = entry.conn
        assert conn is not None
        while True:
            try:
                if not conn.poll(0):
                    return
                seq, busy = HEARTBEAT_ANSWER.unpack(conn.recv_bytes(HEARTBEAT_ANSWER.size))
            except (EOFError, OSError, ValueError):
                entry.closed = True
                return
            now = time.monotonic()
            with self._lock:
                while entry.pending and entry.pending[0][0] <= seq:
                    sent_seq, sent = entry.pending.popleft()
                    if sent_seq == seq and entry.armed:
                        bisect.insort(entry.rtts, now - sent)
                entry.answered += 1
                entry.busy_s = None if busy < 0 else busy
                if len(entry.rtts) > 20000:  # bound the memory: keep the tails
                    del entry.rtts[1:-1:2]

    def _judge(self, conns: dict[Connection, _Rank], probe: bool) -> None:
        """Report what changed for every rank; with `probe`, send each its next probe."""
        # Answers already here first: a late tick must not blame a rank for its own delay.
        try:
            for conn in wait(list(conns), 0):
                self._read_answers(conns[conn])  # type: ignore[index]
        except OSError:
            pass
        now = time.monotonic()
        with self._lock:
            for rank, entry in enumerate(self._ranks):
                if entry is None:
                    continue
                problem = self._problem(entry, now)
                if problem is None:
                    entry.last_ok = now
                elif problem.startswith(_SILENT):
                    # Silent since its oldest unanswered probe (answers would have come).
                    entry.last_ok = min(entry.last_ok, entry.pending[0][1])
                if problem != entry.reported:
                    entry.reported = problem
                    # Under the lock: a rank detached meanwhile is never reported.
                    self._on_change(rank, problem, entry.last_ok)
                if probe:
                    self._probe(entry, now)

    def _problem(self, entry: _Rank, now: float) -> str | None:
        problem = local_process_problem(entry.pid, entry.host, entry.start_time)
        if problem is not None:
            return problem
        if entry.closed:
            return "its heartbeat connection closed (the process is gone?)"
        if entry.armed and entry.pending and now - entry.pending[0][1] >= self.timeout_s:
            if entry.reported is not None and entry.reported.startswith(_SILENT):
                return entry.reported  # the same silence: reported once
            silent = now - entry.pending[0][1]
            return f"{_SILENT} for {silent:.1f} s (frozen?)"
        return None

    def _probe(self, entry: _Rank, now: float) -> None:
        if entry.conn is None or entry.closed or len(entry.pending) >= _MAX_PENDING:
            return
        entry.next_seq += 1
        try:
            # A few bytes: never blocks (a silent rank is declared long before its buffer
            # could fill).
            entry.conn.send_bytes(HEARTBEAT_PROBE.pack(entry.next_seq))
        except (OSError, ValueError):
            entry.closed = True
            return
        entry.pending.append((entry.next_seq, now))
