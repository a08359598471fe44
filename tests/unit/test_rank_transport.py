"""The rank transport's security (`vllm.distributed.rank_handshake`, `serialization`, the verb
table of `vllm.worker.rank_server`): who may connect, what an eavesdropper sees, what a
message may name, what a rank answers. Ranks are served on threads of this process."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import socket
import struct
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

import pytest
import torch

from vllm.distributed.rank_handshake import MAGIC, HandshakeKey, SealedConnection, rank_handshake
from vllm.distributed.rank_verbs import UnknownVerbError, Verb
from vllm.distributed.serialization import (
    RefusedGlobalError,
    dumps_message,
    loads_message,
)
from vllm.executor.base import ExecutorBase
from vllm.executor.rank_calls import RankCallError, RankCalls, connect_to_rank
from vllm.lora.registry import LoRARegistry
from vllm.worker.rank_server import (
    VerbSpec,
    VerbTable,
    WorkerHost,
    accept_authenticated,
    serve_calls,
)

pytestmark = pytest.mark.fast


class _Framed:
    """multiprocessing's framing over a socket: what its (pre-3.12: HMAC-MD5) challenge
    functions speak."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(struct.pack("!i", len(data)) + data)

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        (size,) = struct.unpack("!i", self._exactly(4))
        if maxlength is not None and size > maxlength:
            raise OSError("bad message length")
        return self._exactly(size)

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data


def _listen(engine_public: bytes, timeout: float = 2.0):
    """A rank's listener on a thread: (address, rank key, queue of accepted connections)."""
    server = socket.create_server(("127.0.0.1", 0))
    key = HandshakeKey()
    accepted: queue.SimpleQueue[Connection] = queue.SimpleQueue()
    threading.Thread(
        target=lambda: accepted.put(accept_authenticated(server, key, engine_public, timeout)),
        daemon=True,
    ).start()
    return server.getsockname()[:2], key, accepted


def _assert_refused_then_engine_served(address, engine, rank_key, accepted) -> None:
    with pytest.raises(queue.Empty):
        accepted.get(timeout=0.5)
    conn = connect_to_rank(address, engine, rank_key.public, timeout=5.0)
    rank_end = accepted.get(timeout=5.0)
    conn.send_bytes(b"ping")
    assert rank_end.recv_bytes() == b"ping"
    conn.close()
    rank_end.close()


def test_handshake_refuses_a_wrong_key_and_serves_the_engine():
    engine = HandshakeKey()
    address, rank_key, accepted = _listen(engine.public)
    with pytest.raises(multiprocessing.AuthenticationError, match="does not accept our key"):
        connect_to_rank(address, HandshakeKey(), rank_key.public, timeout=5.0)
    # The engine's own key against another rank's public key: the rank's tag is wrong.
    with pytest.raises(multiprocessing.AuthenticationError):
        connect_to_rank(address, engine, HandshakeKey().public, timeout=5.0)
    _assert_refused_then_engine_served(address, engine, rank_key, accepted)


def test_handshake_refuses_an_md5_era_peer():
    """Python 3.11's connection handshake (HMAC-MD5), even with the connection's own shared
    secret as its key: a client speaking it is refused by the rank, and an engine refuses a
    rank speaking it."""
    engine = HandshakeKey()
    address, rank_key, accepted = _listen(engine.public)
    secret = engine.shared_secret(rank_key.public)
    with socket.create_connection(address, timeout=5.0) as old_client:
        with pytest.raises((multiprocessing.AuthenticationError, EOFError, OSError)):
            answer_challenge(_Framed(old_client), secret)  # type: ignore[arg-type]
            deliver_challenge(_Framed(old_client), secret)  # type: ignore[arg-type]
        _assert_refused_then_engine_served(address, engine, rank_key, accepted)

    # An old rank: it challenges first, with "#CHALLENGE#" instead of the protocol's tag.
    old_server = socket.create_server(("127.0.0.1", 0))

    def old_rank() -> None:
        sock, _ = old_server.accept()
        with sock:
            try:
                deliver_challenge(_Framed(sock), secret)  # type: ignore[arg-type]
            except (multiprocessing.AuthenticationError, EOFError, OSError):
                pass

    threading.Thread(target=old_rank, daemon=True).start()
    with pytest.raises(multiprocessing.AuthenticationError, match="does not speak"):
        connect_to_rank(old_server.getsockname()[:2], engine, rank_key.public, timeout=5.0)
    old_server.close()


class _Tap:
    """A TCP relay between the engine and a rank that records every byte it forwards (what an
    eavesdropper between the nodes sees) and can flip one byte of what the engine sends."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.recorded = bytearray()
        self.flip_at: int | None = None
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = self._server.getsockname()[:2]
        threading.Thread(target=self._run, args=(target,), daemon=True).start()

    def _run(self, target: tuple[str, int]) -> None:
        engine_side, _ = self._server.accept()
        rank_side = socket.create_connection(target)
        for src, dst, upstream in ((engine_side, rank_side, True), (rank_side, engine_side, False)):
            threading.Thread(target=self._pump, args=(src, dst, upstream), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        sent = 0
        while True:
            try:
                data = bytearray(src.recv(65536))
            except OSError:
                data = bytearray()
            if not data:
                for sock in (src, dst):
                    sock.close()
                return
            self.recorded += data
            if upstream and self.flip_at is not None and sent <= self.flip_at < sent + len(data):
                data[self.flip_at - sent] ^= 0x01
            sent += len(data)
            dst.sendall(data)


def test_only_public_keys_leave_a_process_and_a_recording_opens_nothing():
    """What crosses Ray (the engine's public key to the actor, the rank's back) and every byte
    on the wire hold neither private key nor the shared secret; replaying the engine's
    recorded handshake to the rank fails (the rank's nonce is new each time)."""
    engine, rank_key = HandshakeKey(), HandshakeKey()
    server = socket.create_server(("127.0.0.1", 0))
    accepted: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def rank() -> None:
        for _ in range(2):  # the engine, then the eavesdropper's replay
            sock, _ = server.accept()
            try:
                accepted.put(rank_handshake(sock, rank_key, engine.public, 5.0, server_side=True))
            except (multiprocessing.AuthenticationError, EOFError, OSError) as exc:
                accepted.put(exc)
                sock.close()

    threading.Thread(target=rank, daemon=True).start()
    tap = _Tap(server.getsockname()[:2])
    conn = connect_to_rank(tap.address, engine, rank_key.public, timeout=5.0)
    rank_end = accepted.get(timeout=5.0)
    assert isinstance(rank_end, SealedConnection)
    conn.send_bytes(b"a step message")
    assert rank_end.recv_bytes() == b"a step message"
    conn.close()
    rank_end.close()

    crossing_ray = engine.public + rank_key.public
    secret = engine.shared_secret(rank_key.public)
    assert secret == rank_key.shared_secret(engine.public)
    wire = bytes(tap.recorded)
    for place in (crossing_ray, wire):
        assert secret not in place
        # A private key is never serialised at all: only its public part exists as bytes.
    assert MAGIC in wire  # the tap did see the handshake

    # The eavesdropper replays the engine's half of the recorded handshake.
    engine_half = wire[len(MAGIC) + 32 : len(MAGIC) + 32 + 64]
    with socket.create_connection(server.getsockname()[:2], timeout=5.0) as replay:
        replay.recv(len(MAGIC) + 32)
        replay.sendall(engine_half)
        refused = accepted.get(timeout=5.0)
    assert isinstance(refused, multiprocessing.AuthenticationError)
    assert "does not verify" in str(refused)
    server.close()


def test_a_message_altered_after_the_handshake_is_refused():
    """An attacker on the path flips one byte of a call after the handshake: the rank's read
    fails its HMAC check, and the rank stops serving that connection (the engine then finds
    the rank lost)."""
    engine, rank_key = HandshakeKey(), HandshakeKey()
    server = socket.create_server(("127.0.0.1", 0))
    results: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def rank() -> None:
        sock, _ = server.accept()
        conn = rank_handshake(sock, rank_key, engine.public, 5.0, server_side=True)
        results.put(conn.recv_bytes())
        try:
            results.put(conn.recv_bytes())
        except multiprocessing.AuthenticationError as exc:
            results.put(exc)
        conn.close()

    threading.Thread(target=rank, daemon=True).start()
    tap = _Tap(server.getsockname()[:2])
    conn = connect_to_rank(tap.address, engine, rank_key.public, timeout=5.0)
    conn.send_bytes(b"first")
    assert results.get(timeout=5.0) == b"first"
    # The next message's first body byte: after the handshake (64 bytes from the engine) and
    # the first message (4-byte length, 5 bytes, 32-byte tag), past its 4-byte length.
    tap.flip_at = 64 + (4 + 5 + 32) + 4
    conn.send_bytes(b"second")
    refused = results.get(timeout=5.0)
    assert isinstance(refused, multiprocessing.AuthenticationError)
    assert "HMAC-SHA256" in str(refused)
    conn.close()
    server.close()


class _System:
    """A payload that, unpickled by plain pickle, runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> Any:
        return os.system, (self.command,)


@pytest.mark.parametrize("allow_user_code", [False, True])
def test_a_message_naming_a_forbidden_callable_is_refused(tmp_path, allow_user_code):
    marker = tmp_path / "ran"
    evil = pickle.dumps(([_System(f"touch {marker}")], {}))
    with pytest.raises(RefusedGlobalError, match=r"refused to unpickle (posix|os)\.system"):
        loads_message(evil, allow_user_code=allow_user_code)
    assert not marker.exists()
    for module, name in (("builtins", "eval"), ("torch.storage", "_load_from_bytes")):
        forged = pickle.dumps(None, protocol=2).replace(b"N.", f"c{module}\n{name}\n)R.".encode())
        with pytest.raises(RefusedGlobalError, match=f"{module}.{name}"):
            loads_message(forged, allow_user_code=allow_user_code)


def test_a_rank_refuses_a_forbidden_class_in_a_call_and_says_so(tmp_path):
    """Over the calls connection: the rank answers the call with the refusal (nothing ran),
    and keeps serving."""
    calls = RankCalls(1)
    engine_end, rank_end = multiprocessing.Pipe(duplex=True)
    threading.Thread(target=serve_calls, args=(rank_end, WorkerHost()), daemon=True).start()
    calls.attach(0, engine_end)
    marker = tmp_path / "ran"
    try:
        payload = pickle.dumps(((_System(f"touch {marker}"),), {}))
        engine_end.send_bytes(pickle.dumps((1, "get_stage_info", payload)))
        with pytest.raises(RankCallError, match=r"RefusedGlobalError: refused to unpickle"):
            calls.wait_for(0, 1, 10.0)
        assert not marker.exists()
    finally:
        calls.close()


def test_user_code_only_travels_to_ranks_and_tensors_round_trip():
    offset = 5
    message = ((lambda x: x + offset,), {})
    data = dumps_message(message)
    (fn,), _ = loads_message(data, allow_user_code=True)
    assert fn(1) == 6
    # The engine reading a rank's reply accepts no code.
    with pytest.raises(RefusedGlobalError, match="user code"):
        loads_message(data)
    tensors = [
        torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)[:, 1:],  # not contiguous
        torch.randn(2, 3),
        torch.tensor(7, dtype=torch.int64),
        torch.empty(0, 4, dtype=torch.float16),
    ]
    back = loads_message(dumps_message(tensors))
    for got, want in zip(back, tensors):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_an_unknown_verb_is_named_with_the_known_ones():
    host = WorkerHost()
    # Before, a call named any attribute: the host's own `__init__` or a Worker method.
    for verb in ("__init__", "call", "busy_s", "list_loras"):
        with pytest.raises(UnknownVerbError, match=f"unknown verb '{verb}'") as info:
            host.call(verb, (), {})
        assert "execute_model" in str(info.value) and "shutdown" in str(info.value)
    with pytest.raises(TypeError, match="initialize_cache: parameter 'num_gpu_blocks' must be int"):
        host.call(Verb.INITIALIZE_CACHE, ("12", 3), {})
    with pytest.raises(TypeError, match="get_stage_stats has no parameter 'rest'"):
        host.call(Verb.GET_STAGE_STATS, (), {"rest": True})
    with pytest.raises(RuntimeError, match="no Worker yet"):
        host.call(Verb.LOAD_MODEL, (), {})


class _Executor(ExecutorBase):
    """Only the part of an executor that runs verbs on its ranks (never started)."""

    def __init__(self) -> None:  # no workers: nothing is started
        self.ran: list[tuple[Verb, tuple]] = []

    def _init_workers(self) -> None:
        raise AssertionError("not started")

    def _run_workers(self, method: Verb, *args: Any, **kwargs: Any) -> list[Any]:
        self.ran.append((method, args))
        return [None, None]

    def _submit_step(self, request: Any, num_tokens: int) -> Any:
        raise AssertionError("no steps")

    def _release_workers(self, graceful: bool) -> None:
        pass


def test_collective_rpc_takes_verbs_only_and_the_lora_registry_uses_it(tmp_path):
    from vllm.config import LoRAConfig

    executor = _Executor()
    with pytest.raises(UnknownVerbError, match="unknown verb 'system'"):
        executor.collective_rpc("system", args=("ls",))  # type: ignore[arg-type]
    assert executor.collective_rpc(Verb.GET_STAGE_INFO) == [None, None]
    # The registry reaches the ranks through the public method only.
    registry = LoRARegistry(LoRAConfig(max_lora_rank=8), executor)
    assert not registry.remove(3)
    assert executor.ran == [(Verb.GET_STAGE_INFO, ()), (Verb.SYNC_LORAS, (registry.config, []))]


def test_a_ray_actor_is_given_and_gives_back_public_keys_only():
    """The actor body's calls through Ray (`open_calls`, `open_heartbeat`) carry the engine's
    public key in and the rank's public key out: the connection's secret is in neither, yet
    the engine completes the handshake with them."""
    from vllm.executor.ray_utils import RayWorkerWrapper

    engine = HandshakeKey()
    actor = RayWorkerWrapper()  # the class Ray runs as the actor, here in this process
    ip, port, rank_public = actor.open_calls(engine.public)
    beat_ip, beat_port, beat_public, _, _ = actor.open_heartbeat(engine.public)
    secrets = [engine.shared_secret(rank_public), engine.shared_secret(beat_public)]
    crossing = pickle.dumps([engine.public, (ip, port, rank_public), (beat_ip, beat_port)])
    assert all(secret not in crossing for secret in secrets)
    calls = RankCalls(1)
    try:
        calls.attach(0, connect_to_rank((ip, port), engine, rank_public, timeout=10.0))
        with pytest.raises(RankCallError, match="no Worker yet"):
            calls.wait_for(0, calls.broadcast(Verb.GET_STAGE_INFO, [0]), 10.0)
        beat = connect_to_rank((beat_ip, beat_port), engine, beat_public, timeout=10.0)
        beat.send_bytes(struct.pack("!Q", 7))
        assert struct.unpack("!Qd", beat.recv_bytes())[0] == 7
        beat.close()
    finally:
        calls.close()


def test_the_engine_refuses_code_in_a_ranks_reply():
    """A compromised rank answers with a function: the engine does not load it, and the rank
    is lost at once, naming why."""
    calls = RankCalls(1)
    engine_end, rank_end = multiprocessing.Pipe(duplex=True)
    rank_host = VerbTable({"get_stage_info": VerbSpec(lambda: lambda: os.system("true"))})
    threading.Thread(target=serve_calls, args=(rank_end, rank_host), daemon=True).start()
    calls.attach(0, engine_end)
    try:
        with pytest.raises(RankCallError, match="its reply was refused .*user code") as info:
            calls.wait_for(0, calls.broadcast(Verb.GET_STAGE_INFO, [0]), 10.0)
        assert info.value.lost
    finally:
        calls.close()
