"""The engine's calls to its ranks (`vllm.executor.rank_calls`), with ranks served on threads
of this process: order, results by id, a rank's error or loss failing every wait at once,
deadlines, forgotten calls, cloudpickle for what pickle refuses, and the TCP handshake."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from typing import Any

import pytest

from vllm.distributed.rank_handshake import HandshakeKey
from vllm.executor import rank_calls
from vllm.executor.rank_calls import RankCallError, RankCalls, RankCallTimeout, connect_to_rank
from vllm.worker.rank_server import (
    CallsThread,
    VerbSpec,
    VerbTable,
    WorkerHost,
    say_last_words,
    serve_calls,
)

pytestmark = pytest.mark.fast


class _Echo:
    """A stand-in Worker: records the order of its calls."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def step(self, x: Any) -> Any:
        self.seen.append(x)
        return x

    def apply(self, fn: Any, x: Any) -> Any:
        return fn(x)

    def sleep(self, s: float) -> str:
        time.sleep(s)
        return "woke"

    def fail(self) -> None:
        raise ValueError("bad step on this rank")

    def vanish(self) -> None:
        """As if the process died mid-call: its end of the connection closes."""
        self.conn.close()


class _EchoHost:
    """A stand-in WorkerHost: the same fixed table of verbs, with the echo's."""

    def __init__(self) -> None:
        self.worker = _Echo()
        anything = ("x", object)
        params: dict[str, tuple] = {
            "step": (anything,),
            "apply": (("fn", object), anything),
            "sleep": (("s", (int, float)),),
            "fail": (),
            "vanish": (),
        }
        self.table = VerbTable(
            {verb: VerbSpec(getattr(self.worker, verb), p) for verb, p in params.items()}
        )

    def call(self, verb: str, args: tuple, kwargs: dict) -> Any:
        return self.table.call(verb, args, kwargs)


def _serve_on_thread(calls: RankCalls, rank: int) -> _EchoHost:
    engine_end, rank_end = multiprocessing.Pipe(duplex=True)
    host = _EchoHost()
    host.worker.conn = rank_end
    thread = threading.Thread(target=serve_calls, args=(rank_end, host), daemon=True)
    thread.start()
    calls.attach(rank, engine_end)
    return host


@pytest.fixture
def two_ranks():
    calls = RankCalls(2)
    yield calls, [_serve_on_thread(calls, rank) for rank in range(2)]
    calls.close()


def test_calls_run_in_order_and_results_come_by_id(two_ranks):
    calls, hosts = two_ranks
    ids = [calls.submit({0: ("step", (i,), {}), 1: ("step", (-i,), {})}) for i in range(20)]
    # Collected newest first: every result waits under its own id.
    for i in reversed(range(20)):
        assert calls.wait_all([0, 1], ids[i], 5.0) == [i, -i]
    assert hosts[0].worker.seen == list(range(20))
    assert hosts[1].worker.seen == [-i for i in range(20)]


def test_one_ranks_error_fails_a_wait_on_another_rank(two_ranks):
    calls, _ = two_ranks
    slow = calls.submit({1: ("sleep", (5.0,), {})})
    calls.submit({0: ("fail", (), {})})
    started = time.monotonic()
    with pytest.raises(RankCallError, match="ValueError: bad step on this rank") as info:
        calls.wait_for(1, slow, 30.0)
    assert info.value.rank == 0 and not info.value.lost
    assert time.monotonic() - started < 3.0
    # The error stays until forgotten (the engine recovers), then calls go on.
    calls.forget()
    assert calls.wait_for(0, calls.broadcast("step", [0], "again"), 10.0) == "again"


def test_a_lost_rank_fails_waits_at_once(two_ranks):
    calls, _ = two_ranks
    call_id = calls.submit({1: ("sleep", (5.0,), {})})
    calls.submit({0: ("vanish", (), {})})
    started = time.monotonic()
    with pytest.raises(RankCallError, match="connection closed") as info:
        calls.wait_for(1, call_id, 30.0)
    assert time.monotonic() - started < 3.0
    assert info.value.rank == 0 and info.value.lost
    with pytest.raises(RankCallError) as info:
        calls.submit({0: ("step", (1,), {})})
    assert info.value.lost


def test_renumbered_ranks_keep_their_connections_and_errors():
    """A stage left (`renumber`): old rank 2 is rank 1 now, with its connection, a result
    in transit and an error it reported; a new slot is empty until attached."""
    calls = RankCalls(3)
    hosts = [_serve_on_thread(calls, rank) for rank in range(3)]
    try:
        slow = calls.submit({2: ("sleep", (0.5,), {})})
        calls.detach(1)
        with pytest.raises(RuntimeError, match="detach"):
            calls.renumber([1, 2])  # old rank 0 still attached and not kept
        calls.renumber([0, 2, None])
        # Sent before, answered after: found under the new number.
        assert calls.wait_for(1, slow, 10.0) == "woke"
        assert calls.wait_all([0, 1], calls.broadcast("step", [0, 1], 7), 10.0) == [7, 7]
        assert hosts[2].worker.seen == [7] and hosts[1].worker.seen == []
        with pytest.raises(RankCallError, match="connection is closed"):
            calls.submit({2: ("step", (1,), {})})
        calls.submit({1: ("fail", (), {})})
        with pytest.raises(RankCallError, match="bad step") as info:
            calls.wait_for(0, calls.broadcast("sleep", [0], 1.0), 10.0)
        assert info.value.rank == 1
        calls.forget()
        _serve_on_thread(calls, 2)  # the new slot attached
        assert calls.wait_for(2, calls.broadcast("step", [2], 3), 10.0) == 3
    finally:
        calls.close()


class _Process:
    """A rank process as the reader watches one: its sentinel becomes readable when it dies."""

    def __init__(self) -> None:
        self.sentinel, self._alive = os.pipe()
        self.exitcode: int | None = None

    def die(self, code: int) -> None:
        self.exitcode = code
        os.close(self._alive)


def test_a_rank_that_dies_outside_a_call_says_why():
    """What the mp rank's main does: an error outside any call (here the call envelope
    itself fails to load) is said on the connection before the process dies, and the
    engine names it beside the exit code."""
    calls = RankCalls(1)
    engine_end, rank_end = multiprocessing.Pipe(duplex=True)
    proc = _Process()
    calls.attach(0, engine_end, process=proc)

    def rank_main() -> None:
        try:
            serve_calls(rank_end, WorkerHost())
        except BaseException as exc:
            say_last_words(rank_end, exc)
            proc.die(1)

    threading.Thread(target=rank_main, daemon=True).start()
    engine_end.send_bytes(b"not a call")

    def step() -> None:
        call_id = calls.submit({0: ("step", (1,), {})})
        calls.wait_for(0, call_id, 30.0)

    # The rank may be gone before the call is submitted (then submitting raises) or after.
    with pytest.raises(RankCallError) as info:
        step()
    assert info.value.lost
    assert "the process died (exit code 1): UnpicklingError" in info.value.problem
    assert "rank_server.py:" in info.value.problem  # where it died


def test_deadline(two_ranks):
    calls, _ = two_ranks
    call_id = calls.submit({0: ("sleep", (3.0,), {})})
    started = time.monotonic()
    with pytest.raises(RankCallTimeout, match="missed the 1 s deadline"):
        calls.wait_for(0, call_id, 1.0)
    assert 0.9 < time.monotonic() - started < 2.5


def test_a_suspect_rank_fails_waits_at_once_until_it_clears(two_ranks):
    """What the supervisor reports (a stopped process, a silent heartbeat) fails the wait on
    any rank at once and refuses calls to the rank; withdrawn, calls go on."""
    calls, _ = two_ranks
    slow = calls.submit({1: ("sleep", (5.0,), {})})
    threading.Timer(0.3, calls.set_suspect, (0, "process 7 is stopped (SIGSTOP?)")).start()
    started = time.monotonic()
    with pytest.raises(RankCallError, match="process 7 is stopped") as info:
        calls.wait_for(1, slow, 30.0)
    assert info.value.rank == 0 and info.value.lost
    assert time.monotonic() - started < 2.0
    with pytest.raises(RankCallError, match="stopped"):
        calls.submit({0: ("step", (1,), {})})
    calls.set_suspect(0, None)
    calls.forget()
    assert calls.wait_for(0, calls.broadcast("step", [0], "on"), 10.0) == "on"


def test_a_busy_rank_never_blocks_the_engine_on_a_send(two_ranks):
    """A rank reads its next call only after its current one; calls bigger than the
    connection's buffers queue on the engine's side instead of blocking it."""
    calls, hosts = two_ranks
    calls.submit({0: ("sleep", (2.0,), {})})
    big = b"x" * (8 << 20)
    started = time.monotonic()
    ids = [calls.submit({0: ("step", (big,), {})}) for _ in range(4)]
    assert time.monotonic() - started < 1.0  # 32 MiB queued while the rank sleeps
    assert all(len(calls.wait_for(0, i, 30.0)) == len(big) for i in ids)
    assert len(hosts[0].worker.seen) == 4


def test_forget_drops_results_still_to_come(two_ranks):
    calls, _ = two_ranks
    calls.submit({0: ("sleep", (0.3,), {})})
    calls.submit({0: ("fail", (), {})})
    calls.forget()  # both are still running: their results (and the error) are dropped
    after = calls.submit({0: ("step", ("next",), {})})
    assert calls.wait_for(0, after, 10.0) == "next"


def test_what_pickle_refuses_goes_through_cloudpickle(two_ranks):
    calls, _ = two_ranks
    offset = 7
    call_id = calls.submit({0: ("apply", (lambda x: x + offset, 35), {})})
    assert calls.wait_for(0, call_id, 10.0) == 42


def test_tcp_connection_needs_the_key():
    host = _EchoHost()
    first = []
    calls_thread = CallsThread(host, first=lambda: first.append(threading.get_ident()))
    engine = HandshakeKey()
    ip, port, rank_public = calls_thread.listen("127.0.0.1", engine.public)
    with pytest.raises(multiprocessing.AuthenticationError):
        connect_to_rank((ip, port), HandshakeKey(), rank_public, timeout=10.0)
    # A stranger is turned away; the engine holding the key is served.
    calls = RankCalls(1)
    try:
        calls.attach(0, connect_to_rank((ip, port), engine, rank_public, timeout=10.0))
        assert calls.wait_for(0, calls.broadcast("step", [0], "hello"), 10.0) == "hello"
        # The calls run on the thread that ran `first` (the Ray actor imports torch there).
        call_id = calls.broadcast("apply", [0], lambda _: threading.get_ident(), None)
        assert calls.wait_for(0, call_id, 10.0) == first[0]
    finally:
        calls.close()


def test_a_silent_stranger_does_not_hold_up_the_engine():
    """Connections that say nothing, or send garbage, before the engine connects: each is
    handled on its own thread with a deadline, so the engine is served at once."""
    host = _EchoHost()
    engine = HandshakeKey()
    ip, port, rank_public = CallsThread(host).listen("127.0.0.1", engine.public)
    address = (ip, port)
    silent = socket.create_connection(address)
    garbage = socket.create_connection(address)
    garbage.sendall(b"\x7f\xff\xff\xff" + b"x" * 64)  # a 2 GiB "message": refused
    calls = RankCalls(1)
    try:
        started = time.monotonic()
        calls.attach(0, connect_to_rank(address, engine, rank_public, timeout=5.0))
        assert time.monotonic() - started < 2.0
        assert calls.wait_for(0, calls.broadcast("step", [0], "hello"), 10.0) == "hello"
    finally:
        calls.close()
        silent.close()
        garbage.close()


def test_the_engine_gives_up_on_a_rank_that_never_answers():
    """The engine's side has a deadline too: a listener that never speaks is an error within
    the timeout, not a hang."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        started = time.monotonic()
        with pytest.raises(OSError):
            key = HandshakeKey()
            connect_to_rank(server.getsockname()[:2], key, HandshakeKey().public, timeout=1.0)
        assert time.monotonic() - started < 3.0
    finally:
        server.close()


def test_a_process_that_ended_before_a_renumber_is_found_by_identity(monkeypatch):
    """A stage left: its process (rank 2) was stopped and the ranks renumbered (3 -> 2)
    after the reader saw the exit under the old numbering. That exit belongs to no rank any
    more: nothing is marked lost, and the reader keeps reading the survivors' replies. (It
    once indexed the shrunk rank list with the old number and died, so every later wait ran
    to its deadline: a shrink's rendezvous "missed the 180 s deadline".) A survivor's
    process that exits afterwards is still found."""
    calls = RankCalls(3)
    procs = [_Process() for _ in range(3)]
    hosts = []
    for rank in range(3):
        engine_end, rank_end = multiprocessing.Pipe(duplex=True)
        host = _EchoHost()
        threading.Thread(target=serve_calls, args=(rank_end, host), daemon=True).start()
        calls.attach(rank, engine_end, process=procs[rank])
        hosts.append(host)
    # The reader is held as it sees the exit, until the test has renumbered.
    seen, renumbered = threading.Event(), threading.Event()
    real_wait = rank_calls.wait

    def held_wait(objects, timeout=None):
        ready = real_wait(objects, timeout)
        if procs[2].sentinel in ready and not renumbered.is_set():
            seen.set()
            renumbered.wait(10.0)
        return ready

    monkeypatch.setattr(rank_calls, "wait", held_wait)
    calls._wake_send.send_bytes(b"")  # the reader looks again, through held_wait
    try:
        procs[2].die(-9)
        assert seen.wait(10.0)
        calls.detach(2)
        calls.renumber([0, 1])
        renumbered.set()
        assert calls.wait_all([0, 1], calls.broadcast("step", [0, 1], 5), 10.0) == [5, 5]
        assert hosts[1].worker.seen == [5]
        procs[1].die(1)
        with pytest.raises(RankCallError, match=r"exit code 1") as info:
            calls.wait_for(1, calls.broadcast("sleep", [1], 5.0), 10.0)
        assert info.value.rank == 1 and info.value.lost
    finally:
        calls.close()
