"""A rank's end of the engine's calls: the process that hosts one Worker runs the calls read
from its connection one at a time, in the order sent, and writes back each result (or the
error, with its traceback). The `mp` backend serves them on the pipe of a spawned process,
Ray on a TCP connection a thread of the actor accepts (`CallsThread`); the engine's end is
`vllm.executor.rank_calls`.

Beside them, on a connection and a thread of their own, the rank answers the engine's
heartbeats (`answer_heartbeats`; the engine's end is `vllm.executor.stage_watch`): a step of
any length keeps answering them (torch ops and our kernels release the GIL while they run),
so only a frozen or dead process goes silent.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import queue
import socket
import struct
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

from vllm.distributed.net_utils import authenticated_connection
from vllm.distributed.serialization import MessageNotSerializableError, dumps_message

# A heartbeat probe (its sequence number) and its answer (the number, and the seconds the
# rank has spent in its current step; negative between steps).
HEARTBEAT_PROBE = struct.Struct("!Q")
HEARTBEAT_ANSWER = struct.Struct("!Qd")
# The call id of what a rank's process says on its calls connection as it dies of an error
# outside any call (`say_last_words`); the engine names it in the rank's loss.
LAST_WORDS = -1


class WorkerHost:
    """One rank's Worker inside its own process. A call names a method of the host when it
    has one (building the worker, and what the process does around a worker call), else a
    method of the worker."""

    def __init__(self) -> None:
        self.worker: Any = None

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        own = getattr(type(self), method, None)
        if own is not None and method != "call":
            return own(self, *args, **kwargs)
        return getattr(self.worker, method)(*args, **kwargs)

    def busy_s(self) -> float | None:
        """Seconds in the step in progress, None between steps (read by the heartbeat
        thread while the step runs)."""
        since = getattr(self.worker, "busy_since", None)
        return None if since is None else time.perf_counter() - since

    def init_worker(self, *args: Any, local_rank: int | None = None, **kwargs: Any) -> int:
        """Build the Worker (`Worker(engine_config, rank, ...)`); returns this process's pid.
        `local_rank`: this rank's device index on its node, for a process started before its
        rank was known (an `mp` spare)."""
        from vllm.worker.worker import Worker

        if local_rank is not None:
            os.environ["LOCAL_RANK"] = str(local_rank)
        self.worker = Worker(*args, **kwargs)
        return os.getpid()

    def reshape(self, layer_split: list[int]) -> tuple[int, int]:
        """A new layer split (`Worker.reshape`). The old model and cache were frozen out of
        the cyclic GC at `initialize_cache`: unfrozen first, so whatever of them sits in a
        reference cycle is collected; `initialize_cache` freezes what exists again."""
        gc.unfreeze()
        return self.worker.reshape(layer_split)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        # From here on this process only serves its stage, and what exists now (torch, the
        # model, the cache) lives until it exits. Frozen, it stays out of the cyclic GC's
        # full collections, which would otherwise pause a step now and then for 0.1 s or
        # more -- and a paused stage stalls the whole pipeline.
        gc.collect()
        gc.freeze()


def serve_calls(conn: Connection, host: WorkerHost) -> None:
    """A rank's end: run the calls read from `conn` one at a time and write back each result
    (or the error, with its traceback) until the engine's end is gone."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        call_id, method, payload = pickle.loads(data)
        try:
            args, kwargs = pickle.loads(payload)
            reply = (call_id, True, host.call(method, args, kwargs))
        except BaseException as exc:  # report everything; the engine decides
            reply = (call_id, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            data = dumps_message(reply)
        except MessageNotSerializableError as exc:  # a result the engine cannot be sent
            data = pickle.dumps((call_id, False, f"{method} returned a result that {exc}"))
        try:
            conn.send_bytes(data)
        except (BrokenPipeError, OSError):
            break
    # Also after a "shutdown" call, the engine closes its end first: a rank that closed its
    # own would look lost to an engine still collecting the other ranks' replies.
    conn.close()


def say_last_words(conn: Connection, exc: BaseException) -> None:
    """Tell the engine, on the calls connection, what this process dies of (an error outside
    any call: a lost reply would otherwise leave only "exit code 1"). Best effort."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    with contextlib.suppress(Exception):
        conn.send_bytes(pickle.dumps((LAST_WORDS, False, f"{type(exc).__name__}: {exc}{at}")))


def answer_heartbeats(conn: Connection, busy_s: Callable[[], float | None]) -> None:
    """A rank's heartbeat thread: answer each probe read from `conn` at once, with the time
    spent in the current step, until the engine's end is gone. It runs beside the calls
    thread, never behind a step, so a silent rank is a frozen or dead one."""
    while True:
        try:
            (seq,) = HEARTBEAT_PROBE.unpack(conn.recv_bytes(HEARTBEAT_PROBE.size))
            busy = busy_s()
            conn.send_bytes(HEARTBEAT_ANSWER.pack(seq, -1.0 if busy is None else busy))
        except (EOFError, OSError, struct.error):
            break
    conn.close()


def start_heartbeat_thread(conn: Connection, busy_s: Callable[[], float | None]) -> None:
    """Answer the engine's heartbeats on `conn` from a daemon thread of this process."""
    threading.Thread(
        target=answer_heartbeats, args=(conn, busy_s), daemon=True, name="vllm-heartbeat"
    ).start()


def listen_for_heartbeats(ip: str, authkey: bytes, busy_s: Callable[[], float | None]) -> int:
    """Ray's rank end: listen on `ip` (the returned port) for the engine's heartbeat
    connection, and answer it on a thread of its own once it has proved it holds the key."""
    server = socket.create_server((ip, 0))

    def run() -> None:
        conn = accept_authenticated(server, authkey)
        answer_heartbeats(conn, busy_s)

    threading.Thread(target=run, daemon=True, name="vllm-heartbeat").start()
    return server.getsockname()[1]


HANDSHAKE_TIMEOUT_S = 5.0


def accept_authenticated(server: socket.socket, authkey: bytes) -> Connection:
    """The first connection to `server` that proves it holds `authkey` (then `server` is
    closed). Each connection proves it on a thread of its own within HANDSHAKE_TIMEOUT_S, so
    a stranger that connects and says nothing delays the engine's connection by nothing."""
    accepted: queue.SimpleQueue[Connection] = queue.SimpleQueue()
    with server:
        server.settimeout(0.2)  # look for an authenticated connection this often
        while accepted.empty():
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(
                target=_handshake,
                args=(sock, authkey, accepted),
                daemon=True,
                name="vllm-rank-handshake",
            ).start()
    return accepted.get()


def _handshake(
    sock: socket.socket, authkey: bytes, accepted: queue.SimpleQueue[Connection]
) -> None:
    try:
        conn = authenticated_connection(sock, authkey, HANDSHAKE_TIMEOUT_S, server_side=True)
    except (multiprocessing.AuthenticationError, EOFError, OSError):
        sock.close()  # not our engine: the accept loop keeps waiting for it
        return
    accepted.put(conn)


class CallsThread:
    """A rank's end over TCP (Ray actors): the thread that serves the engine's calls.

    Started when the actor is made, it first runs `first` -- the actor imports torch there:
    torch's profiler client (Kineto) binds itself to the thread that loads torch and refuses
    (or crashes on `stop`) when another thread profiles, and this thread runs every step.
    `listen` then gives it a socket; it serves the first connection that proves it holds the
    key (`accept_authenticated`)."""

    def __init__(self, host: WorkerHost, first: Callable[[], None] | None = None) -> None:
        self._server: queue.SimpleQueue[tuple[socket.socket, bytes]] = queue.SimpleQueue()
        ready = threading.Event()
        threading.Thread(
            target=self._run, args=(host, first, ready), daemon=True, name="vllm-rank-calls"
        ).start()
        ready.wait()

    def listen(self, ip: str, authkey: bytes) -> tuple[str, int]:
        """Listen on `ip`; returns the address the engine connects to."""
        server = socket.create_server((ip, 0))
        self._server.put((server, authkey))
        return ip, server.getsockname()[1]

    def _run(
        self, host: WorkerHost, first: Callable[[], None] | None, ready: threading.Event
    ) -> None:
        try:
            if first is not None:
                first()
        finally:
            ready.set()
        server, authkey = self._server.get()
        serve_calls(accept_authenticated(server, authkey), host)
