"""Calls from the engine to its rank processes over one connection per rank, answered in order:
the engine's end (the rank's end is `vllm.worker.rank_server`).

Both backends use it: the `mp` backend over the pipe to each spawned process, Ray over a TCP
connection the engine opens to each stage actor once it has started (Ray itself then only
places, starts and kills the actors). A call is `(call id, method, args)` one way and
`(call id, ok, result or error text)` back; a rank runs its calls one at a time, in the order
sent (`serve_calls`). The engine's end (`RankCalls`) sends without waiting, so several
micro-batches are inside the pipeline at once, and one reader thread drains every rank's
results as they come; `wait_for` waits for one call and fails at once when any rank reported
an error, was lost, or is suspect (the supervisor found its process stopped or its heartbeat
silent: `set_suspect`).

Why a connection and not one Ray actor call per step: Ray's task path costs each stage
milliseconds between two steps on a busy machine, a pipe or socket a fraction of that
(docs/PERFORMANCE.md, "Measurements behind design choices").
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import queue
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping

from vllm.distributed.rank_handshake import HandshakeKey, rank_handshake
from vllm.distributed.rank_verbs import Verb
from vllm.distributed.serialization import dumps_message, loads_message
from vllm.logger import init_logger
from vllm.worker.rank_server import LAST_WORDS

logger = init_logger(__name__)

# A rank that is lost is noticed within this many seconds, whatever the call's deadline.
_POLL_S = 0.5

# One call as sent to `ranks`: rank -> (verb, args, kwargs). The engine names its calls by
# `Verb`; any other name is the rank's to refuse (`UnknownVerbError`).
Calls = Mapping[int, tuple[Verb | str, tuple, dict]]


class RankCallError(RuntimeError):
    """A rank reported an error for a call, or was lost (its process or connection gone)."""

    def __init__(
        self,
        rank: int,
        problem: str,
        lost: bool = False,
        call_id: int | None = None,
        since: float | None = None,
    ) -> None:
        self.rank = rank
        self.problem = problem
        self.lost = lost
        # The call the rank raised in (None for a lost rank or a missed deadline).
        self.call_id = call_id
        # monotonic() when the rank's trouble began, when the supervisor found it.
        self.since = since
        super().__init__(f"rank {rank}: {problem}")


class RankCallTimeout(RankCallError):
    """A call did not return within its deadline (every rank still alive)."""


def connect_to_rank(
    address: tuple[str, int], key: HandshakeKey, rank_public: bytes, timeout: float
) -> Connection:
    """The engine's end of a rank's TCP connection (see `rank_server.CallsThread`): connected
    and authenticated both ways within `timeout` seconds (`rank_handshake`: the engine's
    `key` against the rank's public key `rank_public`), or an error."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        return rank_handshake(sock, key, rank_public, timeout, server_side=False)
    except BaseException:
        sock.close()
        raise


class _Outbox:
    """Writes one connection's calls on a thread of its own, in order. The engine never
    blocks on a rank: a busy one reads its next call only after its current step, and a big
    step message can fill the connection's buffers; a frozen one never reads (the engine's
    wait finds it by its deadline and heartbeats, not stuck in a write)."""

    def __init__(self, conn: Connection, on_error: Callable[[str], None]) -> None:
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(
            target=self._run, args=(conn, on_error), daemon=True, name="rank-calls-send"
        ).start()

    def put(self, data: bytes) -> None:
        self._queue.put(data)

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self, conn: Connection, on_error: Callable[[str], None]) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                return
            try:
                conn.send_bytes(data)
            except (OSError, ValueError) as exc:  # the peer is gone, or we closed the handle
                on_error(f"its connection is closed ({exc})")
                return


class RankCalls:
    """The engine's end: one connection per rank, a reader thread, results by call id.

    A rank is lost when its connection closes, or (with `process` given to `attach`) when its
    process exits; results it wrote before that are read first. `forget` drops every result
    of the calls made so far, and those still to come (after a failure, the survivors' old
    steps fail too, and nobody wants those errors)."""

    def __init__(self, world_size: int) -> None:
        self._ids = itertools.count(1)
        self._last_id = 0
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._conns: list[Connection | None] = [None] * world_size
        self._outboxes: list[_Outbox | None] = [None] * world_size
        self._procs: list[Any] = [None] * world_size
        # rank -> call id -> (ok, value); filled by the reader thread.
        self._results: list[dict[int, tuple[bool, Any]]] = [{} for _ in range(world_size)]
        self._lost: dict[int, str] = {}
        # What a rank's process said as it died (`rank_server.LAST_WORDS`), named in its loss.
        self._last_words: dict[int, str] = {}
        # rank -> what the supervisor sees wrong with it now (withdrawn if it clears), and
        # since when (monotonic).
        self._suspect: dict[int, tuple[str, float]] = {}
        self._floor = 0
        self._closing = False
        # Wakes the reader when a connection is attached, so it watches the new one at once.
        self._wake_recv, self._wake_send = multiprocessing.Pipe(duplex=False)
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="rank-calls")
        self._reader.start()

    # ---- connections -----------------------------------------------------------------------

    def attach(self, rank: int, conn: Connection, process: Any = None) -> None:
        """Use `conn` for `rank` from now on (a replaced rank gets a clean slate)."""
        # The sender names its connection, not its rank: `renumber` may move it.
        outbox = _Outbox(conn, lambda problem: self._send_failed(conn, problem))
        self._install(rank, conn, outbox, process)
        self._wake_send.send_bytes(b"")

    def detach(self, rank: int) -> None:
        """Stop using `rank`'s connection (its process was killed)."""
        self._install(rank, None, None, None)

    def renumber(self, order: list[int | None]) -> None:
        """The pipeline changed size (`StageProcessExecutor.remove_stages` / `add_stages`):
        new rank i is old rank `order[i]`, with its connection, process and what it reported;
        None gives an empty slot (a rank still to attach). Old ranks not in `order` must be
        detached first. Only between calls: results in transit are matched to their
        connection, not to a rank number, so none is lost."""
        with self._cond:
            kept = {old for old in order if old is not None}
            if any(c is not None for r, c in enumerate(self._conns) if r not in kept):
                raise RuntimeError("renumber: detach the ranks that leave first")

            def moved(items: list[Any], empty: Callable[[], Any]) -> list[Any]:
                return [empty() if old is None else items[old] for old in order]

            def moved_keys(items: dict[int, Any]) -> dict[int, Any]:
                return {new: items[old] for new, old in enumerate(order) if old in items}

            self._conns = moved(self._conns, lambda: None)
            self._outboxes = moved(self._outboxes, lambda: None)
            self._procs = moved(self._procs, lambda: None)
            self._results = moved(self._results, dict)
            self._lost = moved_keys(self._lost)
            self._last_words = moved_keys(self._last_words)
            self._suspect = moved_keys(self._suspect)
        self._wake_send.send_bytes(b"")  # the reader watches the new numbering at once

    def _install(
        self, rank: int, conn: Connection | None, outbox: _Outbox | None, process: Any
    ) -> None:
        """`rank`'s connection, sender and process from now on; its old ones are closed and
        what it reported so far is forgotten."""
        with self._cond:
            old, old_outbox = self._conns[rank], self._outboxes[rank]
            self._conns[rank], self._outboxes[rank] = conn, outbox
            self._procs[rank] = process
            self._results[rank].clear()
            self._lost.pop(rank, None)
            self._last_words.pop(rank, None)
            self._suspect.pop(rank, None)
        if old_outbox is not None:
            old_outbox.stop()
        if old is not None:
            old.close()

    # ---- the reader --------------------------------------------------------------------------

    def _read_loop(self) -> None:
        while not self._closing:
            with self._cond:
                conns = {id(c): (r, c) for r, c in enumerate(self._conns) if c is not None}
                sentinels = {
                    p.sentinel: p
                    for r, p in enumerate(self._procs)
                    if p is not None and r not in self._lost
                }
            watched: list[Any] = [c for _, c in conns.values()]
            watched += [*sentinels, self._wake_recv]
            try:
                ready = wait(watched, timeout=_POLL_S)
            except OSError:  # a connection closed under us: look again
                continue
            for obj in ready:
                if obj is self._wake_recv:
                    try:
                        self._wake_recv.recv_bytes()
                    except (EOFError, OSError):
                        return
                    continue
                try:
                    if isinstance(obj, int):
                        self._process_ended(sentinels[obj])
                    else:
                        rank, conn = conns[id(obj)]
                        self._recv_one(rank, conn)
                except Exception:  # never leave every wait to its deadline: log, read on
                    logger.exception("Reading the ranks' replies failed (reading on)")

    def _process_ended(self, ended: Any) -> None:
        """`ended`, a rank's process, exited: what it wrote before is read, then its rank is
        lost. The ranks may have been renumbered (`renumber`) or the process replaced or
        stopped (`detach`) since the reader looked: it is found by identity, not number."""
        with self._cond:
            rank = self._rank_of_process(ended)
        if rank is None:
            return  # replaced or stopped meanwhile: its successor is watched next round
        # Results it wrote before exiting are still in the pipe: read them first.
        self._drain(rank)
        code = ended.exitcode
        with self._cond:
            rank = self._rank_of_process(ended)
            said = None if rank is None else self._last_words.get(rank)
        if rank is not None:
            problem = f"the process died (exit code {code})"
            self._mark_lost(rank, ended, problem if said is None else f"{problem}: {said}")

    def _rank_of_process(self, proc: Any) -> int | None:
        """The rank whose process `proc` is now, None if none (under the lock)."""
        for rank, current in enumerate(self._procs):
            if current is proc:
                return rank
        return None

    def _recv_one(self, rank: int, conn: Connection) -> bool:
        """Read one result from `conn`; False (and the rank lost, unless its process is
        watched) when the connection is gone."""
        try:
            call_id, ok, value = loads_message(conn.recv_bytes())
        except (AuthenticationError, pickle.UnpicklingError) as exc:
            # A reply that fails its HMAC check or names a refused class (RefusedGlobalError),
            # or is no pickle at all: the connection is
            # not to be trusted any more, whatever its process does.
            self._connection_gone(rank, conn, f"its reply was refused ({exc})", refused=True)
            return False
        except (EOFError, OSError):
            self._connection_gone(rank, conn, "its connection closed (the process is gone?)")
            return False
        with self._cond:
            # Read under the old numbering perhaps (`renumber` meanwhile): the connection says.
            found = self._rank_of(conn, rank)
            if found is not None and call_id == LAST_WORDS:
                self._last_words[found] = value
            elif found is not None and call_id > self._floor:
                self._results[found][call_id] = (ok, value)
                self._cond.notify_all()
        return True

    def _connection_gone(
        self, rank: int, conn: Connection, problem: str, refused: bool = False
    ) -> None:
        """`conn` (`rank`'s, unless renumbered or replaced meanwhile) is closed; its rank is
        lost now when it was `refused` or has no process watched (else the process's exit
        says what happened)."""
        with self._cond:
            current = self._rank_of(conn, rank)
            if current is None:
                return  # replaced meanwhile
            self._conns[current] = None
            proc = self._procs[current]
        conn.close()
        if refused or proc is None:
            self._mark_lost(current, proc, problem)

    def _rank_of(self, conn: Connection, guess: int) -> int | None:
        """The rank `conn` belongs to now (`guess` first), None if it is no rank's (under the
        lock)."""
        if guess < len(self._conns) and self._conns[guess] is conn:
            return guess
        for rank, current in enumerate(self._conns):
            if current is conn:
                return rank
        return None

    def _drain(self, rank: int) -> None:
        with self._cond:
            conn = self._conns[rank] if rank < len(self._conns) else None
        # Each read finds the connection's rank again (`renumber` may move it meanwhile).
        while conn is not None:
            try:
                if not conn.poll(0):
                    return
            except (EOFError, OSError):
                return
            if not self._recv_one(rank, conn):
                return

    def set_suspect(self, rank: int, problem: str | None, since: float | None = None) -> None:
        """What the supervisor sees wrong with `rank` now (stopped, silent; `since` when that
        began, monotonic), or None when it cleared: while set, every wait fails at once naming
        it and no call is sent to it."""
        with self._cond:
            if problem is None:
                self._suspect.pop(rank, None)
            else:
                self._suspect[rank] = (problem, time.monotonic() if since is None else since)
                self._cond.notify_all()

    def _mark_lost(self, rank: int, proc: Any, problem: str) -> None:
        with self._cond:
            if rank < len(self._procs) and self._procs[rank] is proc:
                self._lost[rank] = problem
                self._cond.notify_all()

    # ---- calls -----------------------------------------------------------------------------

    def submit(self, calls: Calls) -> int:
        """Send one call (one id) to each rank in `calls`, without waiting. Arguments that are
        the same objects for several ranks are pickled once.

        All or nothing: every rank's bytes are pickled, and every rank checked reachable,
        before any is sent. A call that cannot be serialised (MessageNotSerializableError) or
        that names a lost rank raises with nothing sent, so no rank runs a step another rank
        never gets (the pipeline would fall out of step and wait out a deadline)."""
        payloads: dict[tuple[int, int], bytes] = {}
        encoded: list[tuple[int, Verb | str, bytes]] = []
        for rank, (method, args, kwargs) in calls.items():
            key = (id(args), id(kwargs))
            payload = payloads.get(key)
            if payload is None:
                payload = payloads[key] = dumps_message((args, kwargs))
            encoded.append((rank, method, payload))
        with self._send_lock:  # one call's bytes at a time on each connection, ids in order
            outboxes = [self._outbox(rank) for rank, _, _ in encoded]
            call_id = next(self._ids)
            self._last_id = call_id
            for outbox, (_, method, payload) in zip(outboxes, encoded):
                # A tuple of an int, a str and bytes: plain pickle never refuses it.
                name = method.value if isinstance(method, Verb) else method
                envelope = (call_id, name, payload)
                outbox.put(pickle.dumps(envelope, pickle.HIGHEST_PROTOCOL))
        return call_id

    def broadcast(self, method: Verb | str, ranks: list[int], *args: Any, **kwargs: Any) -> int:
        return self.submit({rank: (method, args, kwargs) for rank in ranks})

    def _outbox(self, rank: int) -> _Outbox:
        """The sender queue of `rank`; RankCallError when the rank is lost or closed."""
        with self._cond:
            lost = self._lost.get(rank) or self._suspect.get(rank, (None,))[0]
            outbox = self._outboxes[rank]
        if lost is not None:
            raise RankCallError(rank, lost, lost=True)
        if outbox is None:
            raise RankCallError(rank, "its connection is closed", lost=True)
        return outbox

    def _send_failed(self, conn: Connection, problem: str) -> None:
        with self._cond:
            rank = self._rank_of(conn, 0)
            if rank is not None and rank not in self._lost:
                self._lost[rank] = problem
                self._cond.notify_all()

    def wait_for(self, rank: int, call_id: int, timeout: float) -> Any:
        """One call's result. Fails at once when any rank reported an error, was lost or is
        suspect, and after `timeout` seconds (0: never)."""
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while True:
            with self._cond:
                entry = self._results[rank].get(call_id)
                if entry is not None and entry[0]:
                    del self._results[rank][call_id]
                    return entry[1]
                self._raise_failure()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise RankCallTimeout(rank, f"missed the {timeout:.0f} s deadline")
                self._cond.wait(_POLL_S if deadline is None else min(_POLL_S, deadline - now))

    def wait_all(self, ranks: list[int], call_id: int, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout if timeout > 0 else None
        out = []
        for rank in ranks:
            left = 0.0 if deadline is None else max(deadline - time.monotonic(), 1e-3)
            out.append(self.wait_for(rank, call_id, left))
        return out

    def _raise_failure(self) -> None:
        """Raise for the first rank that reported an error, else the first lost, else the first
        suspect (under the lock)."""
        for rank, results in enumerate(self._results):
            for call_id, (ok, value) in results.items():
                if not ok:
                    raise RankCallError(rank, f"raised {value}", call_id=call_id)
        if self._lost:
            rank = min(self._lost)
            raise RankCallError(rank, self._lost[rank], lost=True)
        if self._suspect:
            rank = min(self._suspect)
            problem, since = self._suspect[rank]
            raise RankCallError(rank, problem, lost=True, since=since)

    def drop_through(self, call_id: int) -> None:
        """Drop the successful results of calls up to `call_id` (the other ranks' part of a
        collected step, and steps nobody collects); errors stay, to fail the next wait."""
        with self._cond:
            for results in self._results:
                for cid in [c for c, (ok, _) in results.items() if ok and c <= call_id]:
                    del results[cid]

    def forget(self) -> None:
        """Drop every result of the calls made so far, errors too, and those still to come."""
        with self._cond:
            self._floor = self._last_id
            for results in self._results:
                results.clear()

    def close(self) -> None:
        self._closing = True
        with self._cond:
            conns = [c for c in self._conns if c is not None]
            outboxes = [o for o in self._outboxes if o is not None]
            self._conns = [None] * len(self._conns)
            self._outboxes = [None] * len(self._outboxes)
            self._procs = [None] * len(self._procs)
        for outbox in outboxes:
            outbox.stop()
        for conn in conns:
            conn.close()
        try:
            self._wake_send.send_bytes(b"")
        except OSError:
            pass
        if self._reader is not threading.current_thread():
            self._reader.join(2.0)
        self._wake_send.close()
        self._wake_recv.close()
