"""A rank's end of the engine's calls: the process that hosts one Worker runs the calls read
from its connection one at a time, in the order sent, and writes back each result (or the
error, with its traceback). The `mp` backend serves them on the pipe of a spawned process,
Ray on a TCP connection a thread of the actor accepts (`CallsThread`); the engine's end is
`vllm.executor.rank_calls`.

Beside them, on a connection and a thread of their own, the rank answers the engine's
heartbeats (`answer_heartbeats`; the engine's end is `vllm.executor.supervisor`): a step of
any length keeps answering them (torch ops and our kernels release the GIL while they run),
so only a frozen or dead process goes silent.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import queue
import socket
import struct
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any, Callable, Mapping, Protocol

from vllm.distributed.rank_handshake import HandshakeKey, rank_handshake
from vllm.distributed.rank_verbs import UnknownVerbError, Verb
from vllm.distributed.serialization import (
    MessageNotSerializableError,
    dumps_message,
    loads_message,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# A heartbeat probe (its sequence number) and its answer (the number, and the seconds the
# rank has spent in its current step; negative between steps).
HEARTBEAT_PROBE = struct.Struct("!Q")
HEARTBEAT_ANSWER = struct.Struct("!Qd")
# The call id of what a rank's process says on its calls connection as it dies of an error
# outside any call (`say_last_words`); the engine names it in the rank's loss.
LAST_WORDS = -1


class CallHandler(Protocol):
    """What answers a rank's calls (`serve_calls`): a table of verbs."""

    def call(self, verb: str, args: tuple, kwargs: dict) -> Any: ...


# A parameter's name and the types its value may have.
Param = tuple[str, type | tuple[type, ...]]


@dataclass(frozen=True)
class VerbSpec:
    """One verb's handler and its parameters, in order (a call may pass each positionally
    or by name)."""

    handler: Callable[..., Any]
    params: tuple[Param, ...] = ()


class VerbTable:
    """A fixed table of verbs: a call naming another verb raises UnknownVerbError (naming
    it and the known ones), an argument of another type TypeError naming the parameter."""

    def __init__(self, verbs: Mapping[str, VerbSpec]) -> None:
        self._verbs = dict(verbs)

    def verbs(self) -> list[str]:
        return sorted(self._verbs)

    def call(self, verb: str, args: tuple, kwargs: dict) -> Any:
        spec = self._verbs.get(verb) if isinstance(verb, str) else None
        verb = verb.value if isinstance(verb, Verb) else verb  # its name in what is said
        if spec is None:
            raise UnknownVerbError(verb, list(self._verbs))
        if len(args) > len(spec.params):
            raise TypeError(f"{verb} takes {len(spec.params)} arguments, {len(args)} given")
        named = dict(spec.params)
        given = list(zip((name for name, _ in spec.params), args)) + list(kwargs.items())
        for name, value in given:
            if name not in named:
                raise TypeError(f"{verb} has no parameter {name!r}")
            if not isinstance(value, named[name]):
                raise TypeError(
                    f"{verb}: parameter {name!r} must be {_type_names(named[name])}, "
                    f"got {type(value).__name__}"
                )
        return spec.handler(*args, **kwargs)


def _type_names(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join("None" if t is type(None) else t.__name__ for t in types)


_NONE = type(None)


class WorkerHost:
    """One rank's Worker inside its own process, and the table of verbs it answers
    (`vllm.distributed.rank_verbs.Verb`): building the worker, what the process does around
    a worker call, and the Worker's own calls."""

    def __init__(self) -> None:
        self.worker: Any = None
        # The built Worker's answer to each verb (`worker.worker_verbs`).
        self.handlers: dict[Verb, Callable[..., Any]] | None = None
        self.table = VerbTable(self._verbs())

    def call(self, verb: str, args: tuple, kwargs: dict) -> Any:
        return self.table.call(verb, args, kwargs)

    def _verbs(self) -> dict[str, VerbSpec]:
        from vllm.config import EngineConfig, LoRAConfig
        from vllm.distributed.pipeline_shape import PipelineShape
        from vllm.lora.request import LoRARequest
        from vllm.step_records import ExecuteModelRequest

        def on_worker(verb: Verb, *params: Param) -> VerbSpec:
            def handler(*args: Any, **kwargs: Any) -> Any:
                if self.worker is None or self.handlers is None:
                    raise RuntimeError(
                        f"{verb.value}: this rank has no Worker yet (init_worker first)"
                    )
                return self.handlers[verb](*args, **kwargs)

            return VerbSpec(handler, params)

        blocks = (("num_gpu_blocks", int), ("num_cpu_blocks", int))
        optional_int = (int, _NONE)
        specs = [
            (
                Verb.INIT_WORKER,
                VerbSpec(
                    self.init_worker,
                    (
                        ("engine_config", EngineConfig),
                        ("rank", int),
                        ("distributed_init_method", (str, _NONE)),
                        ("num_threads", optional_int),
                        ("local_rank", optional_int),
                        ("shape", (PipelineShape, _NONE)),
                    ),
                ),
            ),
            (Verb.INIT_DEVICE, on_worker(Verb.INIT_DEVICE)),
            (Verb.LOAD_MODEL, on_worker(Verb.LOAD_MODEL)),
            (Verb.DETERMINE_NUM_AVAILABLE_BLOCKS, on_worker(Verb.DETERMINE_NUM_AVAILABLE_BLOCKS)),
            (Verb.INITIALIZE_CACHE, VerbSpec(self.initialize_cache, blocks)),
            (Verb.EXECUTE_MODEL, on_worker(Verb.EXECUTE_MODEL, ("request", ExecuteModelRequest))),
            (Verb.REPLAY_STAGES, on_worker(Verb.REPLAY_STAGES, ("request", ExecuteModelRequest))),
            (
                Verb.PROPOSE_DRAFTS,
                on_worker(Verb.PROPOSE_DRAFTS, ("requests", list), ("finished", list)),
            ),
            (
                Verb.REJOIN_PROCESS_GROUPS,
                on_worker(
                    Verb.REJOIN_PROCESS_GROUPS,
                    ("distributed_init_method", str),
                    ("rank", optional_int),
                    ("shape", (PipelineShape, _NONE)),
                ),
            ),
            (Verb.RESHAPE, VerbSpec(self.reshape, (("shape", PipelineShape),))),
            (
                Verb.MERGE_LAYERS,
                on_worker(Verb.MERGE_LAYERS, ("shape", PipelineShape), ("lost", (tuple, list))),
            ),
            (Verb.GROW_MERGED_CACHE, on_worker(Verb.GROW_MERGED_CACHE, *blocks)),
            (
                Verb.REPLAY_GAINED_LAYERS,
                on_worker(Verb.REPLAY_GAINED_LAYERS, ("request", ExecuteModelRequest)),
            ),
            (Verb.FINISH_MERGE, on_worker(Verb.FINISH_MERGE)),
            (
                Verb.SYNC_LORAS,
                on_worker(
                    Verb.SYNC_LORAS, ("lora_config", LoRAConfig), ("requests", (list, tuple))
                ),
            ),
            (Verb.ADD_LORA, on_worker(Verb.ADD_LORA, ("request", LoRARequest))),
            (Verb.REMOVE_LORA, on_worker(Verb.REMOVE_LORA, ("lora_id", int))),
            (Verb.GET_STAGE_INFO, on_worker(Verb.GET_STAGE_INFO)),
            (Verb.GET_STAGE_STATS, on_worker(Verb.GET_STAGE_STATS, ("reset", bool))),
            (Verb.GET_MEMORY_STATS, on_worker(Verb.GET_MEMORY_STATS)),
            (Verb.START_PROFILE, on_worker(Verb.START_PROFILE, ("trace_dir", str))),
            (Verb.STOP_PROFILE, on_worker(Verb.STOP_PROFILE)),
            (Verb.SHUTDOWN, on_worker(Verb.SHUTDOWN)),
        ]
        table = {verb.value: spec for verb, spec in specs}
        missing = {verb.value for verb in Verb} - set(table)
        assert not missing, f"verbs without a handler: {sorted(missing)}"
        return table

    def busy_s(self) -> float | None:
        """Seconds in the step in progress, None between steps (read by the heartbeat
        thread while the step runs)."""
        since = getattr(self.worker, "busy_since", None)
        return None if since is None else time.perf_counter() - since

    def init_worker(
        self,
        engine_config: Any,
        rank: int = 0,
        distributed_init_method: str | None = None,
        num_threads: int | None = None,
        local_rank: int | None = None,
        shape: Any = None,
    ) -> int:
        """Build the Worker (`Worker(engine_config, rank, ...)`); returns this process's pid.
        `local_rank`: this rank's device index on its node, for a process started before its
        rank was known (an `mp` spare); `shape`: the pipeline it joins (None: the configured
        one)."""
        from vllm.worker.worker import Worker, worker_verbs

        if local_rank is not None:
            os.environ["LOCAL_RANK"] = str(local_rank)
        self.worker = Worker(engine_config, rank, distributed_init_method, num_threads, shape)
        self.handlers = worker_verbs(self.worker)
        return os.getpid()

    def reshape(self, shape: Any) -> tuple[int, int]:
        """A new layer split (`Worker.reshape`). The old model and cache were frozen out of
        the cyclic GC at `initialize_cache`: unfrozen first, so whatever of them sits in a
        reference cycle is collected; `initialize_cache` freezes what exists again."""
        gc.unfreeze()
        return self.worker.reshape(shape)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        # From here on this process only serves its stage, and what exists now (torch, the
        # model, the cache) lives until it exits. Frozen, it stays out of the cyclic GC's
        # full collections, which would otherwise pause a step now and then for 0.1 s or
        # more -- and a paused stage stalls the whole pipeline.
        gc.collect()
        gc.freeze()


def serve_calls(conn: Connection, host: CallHandler) -> None:
    """A rank's end: run the calls read from `conn` one at a time and write back each result
    (or the error, with its traceback) until the engine's end is gone. Only message types
    are read (`loads_message`; the engine's calls may carry its users' logits processors)."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError, AuthenticationError):
            break
        try:
            call_id, verb, payload = loads_message(data)
        except pickle.UnpicklingError as exc:
            # Not a call from the engine: this process dies of it, naming this place.
            raise type(exc)(str(exc)) from exc
        try:
            args, kwargs = loads_message(payload, allow_user_code=True)
            reply = (call_id, True, host.call(verb, args, kwargs))
        except BaseException as exc:  # report everything; the engine decides
            reply = (call_id, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            data = dumps_message(reply)
        except MessageNotSerializableError as exc:  # a result the engine cannot be sent
            data = dumps_message((call_id, False, f"{verb} returned a result that {exc}"))
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
        conn.send_bytes(dumps_message((LAST_WORDS, False, f"{type(exc).__name__}: {exc}{at}")))


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


def listen_for_heartbeats(
    ip: str, engine_public: bytes, busy_s: Callable[[], float | None]
) -> tuple[int, bytes]:
    """Ray's rank end: listen on `ip` for the engine's heartbeat connection, and answer it on
    a thread of its own once it has proved who it is (`rank_handshake`, against the engine's
    public key `engine_public`). Returns the port and this listener's public key."""
    server = socket.create_server((ip, 0))
    key = HandshakeKey()

    def run() -> None:
        conn = accept_authenticated(server, key, engine_public)
        answer_heartbeats(conn, busy_s)

    threading.Thread(target=run, daemon=True, name="vllm-heartbeat").start()
    return server.getsockname()[1], key.public


HANDSHAKE_TIMEOUT_S = 5.0


def accept_authenticated(
    server: socket.socket,
    key: HandshakeKey,
    engine_public: bytes,
    timeout: float = HANDSHAKE_TIMEOUT_S,
) -> Connection:
    """The first connection to `server` that completes the handshake as the engine whose
    public key is `engine_public` (then `server` is closed). Each connection gets `timeout`
    seconds on a thread of its own, so a stranger that connects and says nothing delays the
    engine's connection by nothing; one that fails is closed and logged."""
    accepted: queue.SimpleQueue[Connection] = queue.SimpleQueue()
    with server:
        server.settimeout(0.2)  # look for an authenticated connection this often
        while accepted.empty():
            try:
                sock, peer = server.accept()
            except TimeoutError:
                continue
            threading.Thread(
                target=_handshake,
                args=(sock, peer, key, engine_public, timeout, accepted),
                daemon=True,
                name="vllm-rank-handshake",
            ).start()
    return accepted.get()


def _handshake(
    sock: socket.socket,
    peer: Any,
    key: HandshakeKey,
    engine_public: bytes,
    timeout: float,
    accepted: queue.SimpleQueue[Connection],
) -> None:
    try:
        conn = rank_handshake(sock, key, engine_public, timeout, server_side=True)
    except (AuthenticationError, EOFError, OSError) as exc:
        logger.warning("Refused a connection from %s to this rank: %s", peer, exc)
        sock.close()  # not our engine: the accept loop keeps waiting for it
        return
    accepted.put(conn)


class CallsThread:
    """A rank's end over TCP (Ray actors): the thread that serves the engine's calls.

    Started when the actor is made, it first runs `first` -- the actor imports torch there:
    torch's profiler client (Kineto) binds itself to the thread that loads torch and refuses
    (or crashes on `stop`) when another thread profiles, and this thread runs every step.
    `listen` then gives it a socket; it serves the first connection that completes the
    handshake as the engine (`accept_authenticated`)."""

    def __init__(self, host: CallHandler, first: Callable[[], None] | None = None) -> None:
        self._server: queue.SimpleQueue[tuple[socket.socket, HandshakeKey, bytes]] = (
            queue.SimpleQueue()
        )
        ready = threading.Event()
        threading.Thread(
            target=self._run, args=(host, first, ready), daemon=True, name="vllm-rank-calls"
        ).start()
        ready.wait()

    def listen(self, ip: str, engine_public: bytes) -> tuple[str, int, bytes]:
        """Listen on `ip` for the engine whose public key is `engine_public`; returns the
        address the engine connects to and this rank's public key (a key pair of its own,
        made here: only its public part leaves the process)."""
        server = socket.create_server((ip, 0))
        key = HandshakeKey()
        self._server.put((server, key, engine_public))
        return ip, server.getsockname()[1], key.public

    def _run(
        self, host: CallHandler, first: Callable[[], None] | None, ready: threading.Event
    ) -> None:
        try:
            if first is not None:
                first()
        finally:
            ready.set()
        server, key, engine_public = self._server.get()
        serve_calls(accept_authenticated(server, key, engine_public), host)
