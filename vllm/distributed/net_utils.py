"""Addresses for the rendezvous: a free port, this node's reachable IP, the TCP URL.

No torch here: the executors pick ports and build URLs in the engine process before any
stage (and any torch.distributed) exists.
"""

from __future__ import annotations

import os
import socket

from vllm import envs


def get_open_port() -> int:
    """Return a TCP port that is free right now (the OS picks it by binding port 0).

    The port is released before returning, so another process could take it in between; the
    window is tiny and it avoids any hard-coded port colliding with a concurrent run.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])
    except OSError:
        # IPv6-only hosts have no AF_INET socket.
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])


def get_ip() -> str:
    """Return this node's IP address as other nodes can reach it (fallback ``127.0.0.1``).

    ``VLLM_HOST_IP`` overrides the detection (as in vLLM) for multi-homed hosts.
    """
    host_ip = envs.get_str("VLLM_HOST_IP")
    if host_ip:
        return host_ip
    # connect() on a UDP socket sends no packet; it only makes the kernel pick the outgoing
    # interface of the default route, whose address is the one peers can reach.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("8.8.8.8", 80))
            return str(s.getsockname()[0])
    except OSError:
        pass
    try:
        ip = socket.gethostbyname(socket.gethostname())
        if ip and not ip.startswith("127."):
            return ip
    except OSError:
        pass
    return "127.0.0.1"


def get_file_init_method(directory: str, name: str) -> str:
    """A ``file://`` rendezvous in `directory` (ranks on one node): torch's FileStore, a file
    only this user can open -- no port that anyone on the network could reach."""
    return "file://" + os.path.join(os.path.abspath(directory), name)


def get_distributed_init_method(ip: str, port: int) -> str:
    """Return the ``torch.distributed`` TCP rendezvous URL ``tcp://ip:port``."""
    # IPv6 literals must be bracketed inside a URL.
    host = f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip
    return f"tcp://{host}:{port}"


def set_no_delay(sock: socket.socket) -> None:
    """Small messages (a decode step's delta, a result) must leave at once, not wait for
    Nagle's algorithm."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
