"""Stage-to-stage hand-off latency over gloo while both processes compute.

    python -m benchmarks.p2p_latency [--iters 40] [--busy-ms 70]

Two single-threaded processes keep their cores busy with matmuls, as two pipeline stages do,
and exchange the engine's two kinds of message:

  hidden  a decode hand-off (hidden [64, 576] fp32 + positions) to a receiver that finished
          its own work first and is waiting: latency = received - sent.
  ids     a small message (32 sampled (seq, token) pairs) sent at the start of the sender's
          work and taken by the receiver half-way through its own: wait = time in recv.

Each runs twice: with this engine's send/recv_tensor_dict (receives posted ahead, see
vllm/distributed/communication.py), and with plain gloo point-to-point in
the wire format the engine used before (length, pickled header, then each tensor; every
message a rendezvous the busy sender's gloo thread has to answer). Prints median and p90 in
milliseconds. Timestamps are CLOCK_MONOTONIC, shared by the processes of one host.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import print_table
from vllm.distributed import net_utils as net
from vllm.distributed import parallel_state as ps
from vllm.distributed.communication import (
    _recv_header,
    _recv_payload,
    recv_tensor_dict,
    send_tensor_dict,
)


def _busy(seconds: float, a: torch.Tensor) -> None:
    """Keep this core computing for `seconds` (matmuls release the GIL, like a stage's)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        torch.mm(a, a)


def _plain_send(message: dict[str, Any], dst: int) -> list[Any]:
    """The old gloo wire format (the NCCL path's still): length, pickled header, then each
    tensor, every one a separate rendezvous (async)."""
    header = [
        (k, "t", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, "v", v)
        for k, v in message.items()
    ]
    raw = pickle.dumps(header)
    length = torch.tensor([len(raw)], dtype=torch.int64)  # [1]
    header_t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # [n]
    tensors = [v for v in message.values() if isinstance(v, torch.Tensor)]
    return [dist.isend(t, dst) for t in (length, header_t, *tensors)]


def _plain_recv(src: int) -> dict[str, Any]:
    """Its receiving side: the engine's own NCCL-path receive, here on gloo and the CPU."""
    cpu = torch.device("cpu")
    return _recv_payload(_recv_header(src, None, cpu), src, None, cpu)


def _worker(rank: int, port: int, iters: int, busy_s: float, size: int, out: Any) -> None:
    torch.set_num_threads(1)
    ps.init_distributed_environment(
        2, rank, net.get_distributed_init_method("127.0.0.1", port), backend="gloo"
    )
    a = torch.randn(size, size)
    hidden = torch.randn(64, 576)
    positions = torch.arange(64)
    pairs = [(i, 1000 + i) for i in range(32)]
    results: dict[str, list[float]] = {}
    for mode in ("posted ahead (this engine)", "plain gloo rendezvous (before)"):
        posted = mode.startswith("posted")
        send = (lambda m, d: [send_tensor_dict(m, d, async_op=True)]) if posted else _plain_send
        recv = recv_tensor_dict if posted else _plain_recv
        # Warm-up: one message each way (creates the posted receives).
        if rank == 0:
            warm = send({"warm": 0}, 1)
            recv(1)
        else:
            recv(0)
            warm = send({"warm": 1}, 0)
        for work in warm:  # an async send must be kept (and waited for) until it is done
            work.wait()
        dist.barrier()
        lat, wait = [], []
        pending: list[Any] = []
        for _ in range(iters):
            # hidden: rank 0 works, then hands off to rank 1, which finished early and waits.
            if rank == 0:
                _busy(busy_s, a)
                pending += send(
                    {"hidden": hidden, "positions": positions, "t": time.monotonic()}, 1
                )
            else:
                _busy(0.8 * busy_s, a)
                got = recv(0)
                lat.append(time.monotonic() - got["t"])
            # ids: rank 1 sends as it starts working; rank 0 takes them half-way through its own.
            if rank == 1:
                pending += send({"step_no": len(wait), "pairs": pairs}, 0)
                _busy(busy_s, a)
            else:
                _busy(0.5 * busy_s, a)
                started = time.monotonic()
                recv(1)
                wait.append(time.monotonic() - started)
                _busy(0.5 * busy_s, a)
        for work in pending:
            work.wait()
        dist.barrier()
        if rank == 1:
            results[f"{mode}|hidden hand-off latency"] = lat
        else:
            results[f"{mode}|ids: wait in recv"] = wait
    out.put((rank, results))
    ps.destroy_model_parallel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--iters", type=int, default=40, help="Messages of each kind per mode.")
    p.add_argument("--busy-ms", type=float, default=70.0, help="Compute per step (ms).")
    p.add_argument(
        "--matmul-size",
        type=int,
        default=640,
        help="Square matmul the busy loop repeats (640: ~5 ms each, like a stage's GEMMs).",
    )
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = net.get_open_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, port, args.iters, args.busy_ms / 1e3, args.matmul_size, out),
        )
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    results: dict[str, list[float]] = {}
    for _ in procs:
        results.update(out.get(timeout=600)[1])
    for proc in procs:
        proc.join(timeout=60)
    rows = []
    for key in sorted(results):
        mode, what = key.split("|")
        ms = sorted(1e3 * x for x in results[key])
        rows.append([what, mode, f"{statistics.median(ms):.2f}", f"{ms[int(0.9 * len(ms))]:.2f}"])
    print(f"\n=== gloo hand-offs while both processes compute ({args.busy_ms:g} ms steps) ===")
    print_table(["message", "transport", "median ms", "p90 ms"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
