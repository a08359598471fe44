"""How the engine and a rank prove who they are on a TCP connection, and keep it theirs.

Used where a rank listens on the network (the Ray backend: each actor's calls and heartbeat
connections). The `mp` backend needs none of it: its ranks are its own children, reached
through pipes the OS gives only to them.

Threat model
------------
- **Who can connect.** A rank listens on its node's address; anyone who can reach that port
  can open a connection. Only a peer that holds one of the two private keys of the pair
  (the engine's, or this rank's) completes the handshake; every other connection is closed
  within `timeout` seconds, and the rank keeps waiting for its engine.
- **What crosses Ray.** Only public keys: the engine's X25519 public key goes to the actor as
  a call argument (`RayWorkerWrapper.open_calls`), the rank's public key comes back with its
  address. Ray's object traffic between nodes is cleartext unless Ray's own TLS is enabled;
  an eavesdropper there learns both public keys and nothing that lets it authenticate (the
  shared secret is an X25519 product that needs a private key; neither private key ever
  leaves the process that made it). Ray is trusted for integrity: whoever can rewrite Ray's
  traffic can start code in the actors anyway.
- **What crosses the rank connection.** The handshake (a protocol tag, two fresh 32-byte
  nonces, two HMAC-SHA256 tags) and then the messages in the clear, each followed by an
  HMAC-SHA256 tag over its direction, its sequence number and its bytes, under a key of its
  own derived for this connection. An eavesdropper sees the step messages (token ids, the
  sampling parameters) -- use Ray's TLS or a private network when they are confidential --
  but cannot inject, alter, reorder or replay a message: the receiver closes the connection
  at the first tag that does not verify. A recorded handshake replayed to a new connection
  fails (the other end's nonce is new).
- **Not covered here.** The stages' own torch.distributed traffic (hidden states between
  stages, and the TCP rendezvous store when the ranks span nodes) is torch's, unauthenticated
  and in the clear: run multi-node pipelines on a network only the cluster reaches.

The handshake (server: the rank, which speaks first; K = HKDF-SHA256 of the X25519 shared
secret, salted with both nonces, bound to both public keys)::

    rank   -> engine: MAGIC + nonce_r
    engine -> rank:   nonce_e + HMAC(K, "engine" + transcript)
    rank   -> engine: HMAC(K, "rank" + transcript)       (only after the engine's tag verified)

Tags are compared in constant time (`hmac.compare_digest`). A peer speaking Python's
multiprocessing handshake (HMAC-MD5 on Python 3.11) is refused: its first message is not
`MAGIC`, and it cannot answer one.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import socket
import struct
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from vllm.distributed.net_utils import set_no_delay

MAGIC = b"vllm-pp rank handshake v1 (x25519, hmac-sha256)\n"
NONCE_BYTES = 32
TAG_BYTES = 32  # HMAC-SHA256
PUBLIC_KEY_BYTES = 32  # X25519


class HandshakeKey:
    """One end's X25519 key pair, made in the process that uses it; only `public` leaves it."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public: bytes = self._private.public_key().public_bytes_raw()

    def shared_secret(self, peer_public: bytes) -> bytes:
        """The X25519 product with the other end's public key (the same at both ends)."""
        if not isinstance(peer_public, bytes) or len(peer_public) != PUBLIC_KEY_BYTES:
            raise ValueError(
                f"a peer's public key must be {PUBLIC_KEY_BYTES} bytes, got {peer_public!r:.60}"
            )
        return self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))


class _Keys:
    """What one connection derives from the shared secret and its transcript."""

    def __init__(self, shared: bytes, engine_public: bytes, rank_public: bytes, transcript: bytes):
        okm = HKDF(
            algorithm=SHA256(),
            length=3 * 32,
            salt=transcript,
            info=b"vllm-pp rank connection" + engine_public + rank_public,
        ).derive(shared)
        self.handshake, self.engine_to_rank, self.rank_to_engine = okm[:32], okm[32:64], okm[64:]

    def tag(self, who: bytes, transcript: bytes) -> bytes:
        return hmac.new(self.handshake, who + transcript, hashlib.sha256).digest()


class SealedConnection(Connection):
    """A `multiprocessing.connection.Connection` whose every message carries an HMAC-SHA256
    tag over its direction, sequence number and bytes: an injected, altered, dropped or
    replayed message fails the next read with AuthenticationError (the reader then treats
    the connection as closed). One sender and one reader at a time (as `rank_calls` and
    `rank_server` use it)."""

    def __init__(self, handle: int, send_key: bytes, recv_key: bytes) -> None:
        super().__init__(handle)
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = self._received = 0
        self._send_lock = threading.Lock()

    def _send_bytes(self, buf: memoryview) -> None:
        with self._send_lock:
            tag = self._seal(self._send_key, self._sent, buf)
            self._sent += 1
            super()._send_bytes(memoryview(bytes(buf) + tag))  # type: ignore[misc]

    def _recv_bytes(self, maxsize: int | None = None) -> io.BytesIO | None:
        limit = None if maxsize is None else maxsize + TAG_BYTES
        buf: io.BytesIO | None = super()._recv_bytes(limit)  # type: ignore[misc]
        if buf is None:  # longer than `maxsize`: recv_bytes raises
            return None
        size = buf.seek(0, io.SEEK_END) - TAG_BYTES
        if size < 0:
            raise AuthenticationError("a message without its tag on a sealed rank connection")
        with buf.getbuffer() as view:
            with view[:size] as body:
                expected = self._seal(self._recv_key, self._received, body)
            verified = hmac.compare_digest(bytes(view[size:]), expected)
        if not verified:
            raise AuthenticationError(
                f"message {self._received} on a rank connection failed its HMAC-SHA256 check "
                "(altered, injected or replayed)"
            )
        self._received += 1
        buf.truncate(size)
        return buf

    @staticmethod
    def _seal(key: bytes, seq: int, body: memoryview | bytes) -> bytes:
        mac = hmac.new(key, struct.pack("!Q", seq), hashlib.sha256)
        mac.update(body)
        return mac.digest()


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise EOFError("the peer closed the connection during the rank handshake")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _expect_magic(sock: socket.socket) -> None:
    """Read the rank's protocol tag, refusing at the first byte that differs (a peer speaking
    another protocol may send less than a whole tag and then wait)."""
    hello = b""
    while len(hello) < len(MAGIC):
        chunk = sock.recv(len(MAGIC) - len(hello))
        if not chunk:
            raise EOFError("the rank closed the connection during the rank handshake")
        hello += chunk
        if not MAGIC.startswith(hello):
            raise _refuse(
                f"the rank does not speak {MAGIC.strip().decode()!r} (it sent {hello[:24]!r}; "
                "an engine and ranks from different versions?)"
            )


def _refuse(problem: str) -> AuthenticationError:
    return AuthenticationError(f"rank handshake refused: {problem}")


def rank_handshake(
    sock: socket.socket,
    key: HandshakeKey,
    peer_public: bytes,
    timeout: float,
    server_side: bool,
) -> SealedConnection:
    """Run the handshake on `sock` within `timeout` seconds and hand the socket over as a
    blocking SealedConnection. `server_side`: this is the rank (it holds `key`, the engine's
    public key is `peer_public`); else the engine. AuthenticationError for a peer without
    the right key (or speaking another protocol), OSError or EOFError for one that stalls or
    leaves; the caller closes `sock` then."""
    shared = key.shared_secret(peer_public)
    engine_public, rank_public = (
        (peer_public, key.public) if server_side else (key.public, peer_public)
    )
    sock.settimeout(timeout)
    if server_side:
        nonce_r = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + nonce_r)
        reply = _exactly(sock, NONCE_BYTES + TAG_BYTES)
        nonce_e, engine_tag = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    else:
        _expect_magic(sock)
        nonce_r = _exactly(sock, NONCE_BYTES)
        nonce_e = os.urandom(NONCE_BYTES)
    transcript = MAGIC + nonce_r + nonce_e
    keys = _Keys(shared, engine_public, rank_public, transcript)
    if server_side:
        if not hmac.compare_digest(engine_tag, keys.tag(b"engine", transcript)):
            raise _refuse("the engine's tag does not verify (a wrong key, or another protocol)")
        sock.sendall(keys.tag(b"rank", transcript))
    else:
        sock.sendall(nonce_e + keys.tag(b"engine", transcript))
        try:
            rank_tag = _exactly(sock, TAG_BYTES)
        except EOFError:
            raise _refuse("the rank closed the connection: it does not accept our key") from None
        if not hmac.compare_digest(rank_tag, keys.tag(b"rank", transcript)):
            raise _refuse("the rank's tag does not verify (a wrong key)")
    set_no_delay(sock)
    # Connection reads the descriptor directly: it must be back in blocking mode.
    sock.settimeout(None)
    send, recv = keys.rank_to_engine, keys.engine_to_rank
    if not server_side:
        send, recv = recv, send
    return SealedConnection(sock.detach(), send, recv)
