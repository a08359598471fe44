"""Tests for send_tensor_dict/recv_tensor_dict over gloo: edge cases and a transport stress run."""

from __future__ import annotations

import collections
import math
import pickle
import random
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm.distributed import communication as comm
from vllm.distributed import net_utils as net
from vllm.distributed import parallel_state as ps
from vllm.distributed.communication import recv_tensor_dict, send_tensor_dict

STRESS_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
EDGE_DTYPES = STRESS_DTYPES + [torch.float64, torch.int16, torch.int8, torch.complex64]
EDGE_SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (2, 3, 4)]


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor whose bytes are random, so every bit pattern (NaN payloads too) is exercised."""
    numel = math.prod(shape)
    if dtype is torch.bool:  # only 0/1 bytes are valid bools
        return torch.randint(0, 2, (numel,), generator=gen, dtype=torch.uint8).bool().reshape(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)  # [nbytes]
    return raw.view(dtype).reshape(shape)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint8 (bit-exact comparison, NaN == NaN)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _diff(expected: dict[str, Any], got: dict[str, Any]) -> str | None:
    """Describe the first difference between two messages, or None if identical."""
    if list(expected) != list(got):
        return f"keys {list(expected)} != {list(got)}"
    for key, want in expected.items():
        have = got[key]
        if isinstance(want, torch.Tensor):
            if not isinstance(have, torch.Tensor):
                return f"{key}: not a tensor"
            if have.dtype != want.dtype or have.shape != want.shape:
                return f"{key}: {have.dtype}{tuple(have.shape)} != {want.dtype}{tuple(want.shape)}"
            if not have.is_contiguous() or not torch.equal(_raw(have), _raw(want)):
                return f"{key}: data differs"
        elif type(have) is not type(want) or have != want:
            return f"{key}: {have!r} != {want!r}"
    return None


# ---------------------------------------------------------------- edge cases (spawned processes)


def _edge_messages() -> list[dict[str, Any]]:
    """Deterministic messages covering every dtype/shape edge case; both ranks build them."""
    gen = torch.Generator().manual_seed(1234)
    grid = {
        f"{dtype}{shape}": _random_bits(shape, dtype, gen)
        for dtype in EDGE_DTYPES
        for shape in EDGE_SHAPES
    }
    base = _random_bits((4, 6), torch.bfloat16, gen)
    return [
        dict(reversed(grid.items())),  # deliberately not in sorted key order
        {
            "transposed": base.t(),  # non-contiguous
            "strided": base[:, ::2],
            "expanded": torch.tensor([1.5, -2.0]).expand(3, 2),  # stride 0
            "grad": torch.ones(2, 2, requires_grad=True),
        },
        {
            "z": 1,
            "a": -(2**62),
            "inf": float("inf"),
            "s": "héllo ✓",
            "b": False,
            "none": None,
            "list": [1, 2, [3]],
            "tuple": (1, "x"),
            "nested": {"k": [0.5, None]},
            "t": torch.arange(5),
            "after_t": True,  # tensors and values interleaved
        },
        {},
    ]


_RECV_DELAY = 1.5  # seconds the receiver idles before the async round


def _edge_worker(rank: int, port: int) -> None:
    """Rank 0 sends the edge messages (sync, then async), rank 1 receives and checks them."""
    ps.init_distributed_environment(
        2, rank, net.get_distributed_init_method("127.0.0.1", port), backend="gloo"
    )
    ps.initialize_model_parallel(pipeline_parallel_size=2)
    group = ps.get_pp_group()
    messages = _edge_messages()
    if rank == 0:
        dst = ps.get_pipeline_model_parallel_next_rank()
        for msg in messages:
            assert send_tensor_dict(msg, dst, group=group) is None
        # The receiver sleeps before the async round: issuing must not wait for it (that is
        # what lets a stage start its next micro-batch while the previous one is in flight).
        start = time.perf_counter()
        handles = [send_tensor_dict(m, dst, group=group, async_op=True) for m in messages]
        assert time.perf_counter() - start < _RECV_DELAY / 2
        for handle in handles:
            handle.wait()
            assert handle.is_completed()
        handles[0].wait()  # a second wait is a no-op
    else:
        src = ps.get_pipeline_model_parallel_prev_rank()
        for round_ in range(2):
            if round_ == 1:
                time.sleep(_RECV_DELAY)
            for msg in messages:
                got = recv_tensor_dict(src, group=group, device="cpu" if round_ else None)
                assert _diff(msg, got) is None, _diff(msg, got)
    ps.destroy_model_parallel()


def test_edge_cases_two_processes() -> None:
    mp.spawn(_edge_worker, args=(net.get_open_port(),), nprocs=2, join=True)


def test_bad_values_fail_before_any_send() -> None:
    # dist is not initialised here: reaching a send would raise something else.
    assert not dist.is_initialized()
    with pytest.raises(TypeError, match="nests a torch.Tensor"):
        send_tensor_dict({"ok": torch.ones(1), "nested": [1, torch.ones(1)]}, dst=1)
    with pytest.raises((pickle.PicklingError, AttributeError), match="pickle"):
        send_tensor_dict({"fn": lambda: 0}, dst=1)


def _channel_worker(rank: int, port: int) -> None:
    """Rank 0 sends, rank 1 receives: messages land in receives posted ahead; big ones and
    more messages than posted chunks still arrive whole and in order."""
    ps.init_distributed_environment(
        2, rank, net.get_distributed_init_method("127.0.0.1", port), backend="gloo"
    )
    gen = torch.Generator().manual_seed(7)
    chunk = comm._CHUNK_BYTES
    small = [{"step": i, "hidden": torch.randn(32, 576, generator=gen)} for i in range(3)]
    # Around the inline limit (one side goes in chunks, the other as prefix + bulk), a
    # prefill-sized message, and a burst of more one-chunk messages than are posted.
    limit = comm._INLINE_CHUNKS * chunk
    sizes = [limit - 300, limit - 40, limit, limit + 1, 5 * limit]
    mixed = [{"raw": _random_bits((n,), torch.uint8, gen), "n": n} for n in sizes]
    burst = [{"i": i, "ids": torch.arange(i)} for i in range(3 * comm._POSTED_CHUNKS)]
    if rank == 0:
        send_tensor_dict({"hello": 1}, 1)  # once received, the receiver's channel exists
        dist.barrier()
        # The receiver is asleep: small sends must complete without it asking for them.
        # (gloo's is_completed() stays False until wait(), so time the waits.)
        handles = [send_tensor_dict(m, 1, async_op=True) for m in small]
        start = time.monotonic()
        for handle in handles:
            handle.wait()
        landed = time.monotonic() - start < _RECV_DELAY / 2
        dist.barrier()
        handles += [send_tensor_dict(m, 1, async_op=True) for m in mixed + burst]
        for handle in handles:
            handle.wait()
        send_tensor_dict({"landed": landed}, 1)
    else:
        assert recv_tensor_dict(0) == {"hello": 1}
        dist.barrier()
        time.sleep(_RECV_DELAY)
        dist.barrier()
        for msg in small + mixed + burst:
            got = recv_tensor_dict(0)
            assert _diff(msg, got) is None, _diff(msg, got)
        assert recv_tensor_dict(0) == {"landed": True}, "small sends waited for the receiver"
    ps.destroy_model_parallel()
    assert not comm._RECEIVERS  # the posted receives went with the groups


def test_posted_chunk_channel_two_processes() -> None:
    mp.spawn(_channel_worker, args=(net.get_open_port(),), nprocs=2, join=True)


# ---------------------------------------------------------------- stress run (two Ray actors)


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    """A random plain (picklable, NaN-free) value."""
    kind = rng.randrange(9 if depth == 0 else 6)
    if kind == 0:
        return rng.randint(-(2**63), 2**63)
    if kind == 1:
        return rng.choice([rng.uniform(-1e9, 1e9), float("inf"), -0.0, 1e-300])
    if kind == 2:
        return "".join(rng.choice("abcxyz_-é✓ 0") for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.random() < 0.5
    if kind == 4:
        return None
    if kind == 5:
        return [rng.randrange(1000) for _ in range(rng.randrange(6))]
    if kind == 6:
        return tuple(_random_value(rng, depth + 1) for _ in range(rng.randrange(4)))
    if kind == 7:
        return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def _random_message(rng: random.Random, gen: torch.Generator) -> dict[str, Any]:
    """One random message: 0-6 random keys in random order, tensors and plain values."""
    msg: dict[str, Any] = {}
    for _ in range(rng.randrange(7)):
        key = f"{rng.choice(['h', 'pos', 'kv', 'meta'])}{rng.randrange(10**6)}"
        if rng.random() < 0.65:
            shape = tuple(rng.choice([0, 1, 2, 3, 5, 16]) for _ in range(rng.randrange(4)))
            t = _random_bits(shape, rng.choice(STRESS_DTYPES), gen)
            msg[key] = t.t() if t.dim() == 2 and rng.random() < 0.3 else t  # some non-contiguous
        else:
            msg[key] = _random_value(rng)
    return msg


class _StressPeer:
    """One end of the stress run (a Ray actor): joins a 2-rank gloo world chosen by the driver.

    Turned into an actor inside the test, so the spawned edge-case processes that import this
    module do not pay for importing Ray.
    """

    def __init__(self, rank: int, init_method: str) -> None:
        ps.init_distributed_environment(2, rank, init_method, backend="gloo")
        self.rank = rank

    def send_all(self, seed: int, count: int, window: int) -> dict[str, int]:
        """Send ``count`` random messages, mixing sync sends and up to ``window`` async ones."""
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        mode_rng = random.Random(seed + 1)  # sender-only choice, not part of the payload
        pending: collections.deque = collections.deque()
        tensors = 0
        for _ in range(count):
            msg = _random_message(rng, gen)
            tensors += sum(isinstance(v, torch.Tensor) for v in msg.values())
            if mode_rng.random() < 0.5:
                send_tensor_dict(msg, 1 - self.rank)
            else:
                pending.append(send_tensor_dict(msg, 1 - self.rank, async_op=True))
                if len(pending) > window:
                    pending.popleft().wait()
        while pending:
            pending.popleft().wait()
        return {"messages": count, "tensors": tensors}

    def recv_all(self, seed: int, count: int) -> dict[str, Any]:
        """Receive ``count`` messages and check each against the regenerated sequence."""
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        stats: dict[str, Any] = collections.Counter()
        errors: list[str] = []
        for i in range(count):
            want = _random_message(rng, gen)
            got = recv_tensor_dict(1 - self.rank)
            problem = _diff(want, got)
            stats["messages"] += 1
            stats["mismatches"] += problem is not None
            if problem is not None and len(errors) < 5:
                errors.append(f"message {i}: {problem}")
            for value in want.values():
                if isinstance(value, torch.Tensor):
                    stats["tensors"] += 1
                    stats[str(value.dtype)] += 1
                    stats["zero_dim"] += value.dim() == 0
                    stats["zero_numel"] += value.numel() == 0
                    stats["bytes"] += value.numel() * value.element_size()
                else:
                    stats["values"] += 1
        return {**stats, "errors": errors}

    def shutdown(self) -> None:
        ps.destroy_model_parallel()


@pytest.mark.ray
def test_stress_random_dicts_between_ray_actors(ray_session) -> None:
    ray = ray_session
    # pytest imports this file as a top-level module that Ray workers cannot import; ship its
    # classes and functions to the actors by value instead.
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    peer_cls = ray.remote(num_cpus=1)(_StressPeer)
    count, seed = 2500, 20240607
    init_method = net.get_distributed_init_method(net.get_ip(), net.get_open_port())
    peers = [peer_cls.remote(rank, init_method) for rank in range(2)]
    try:
        ray.get([peer.__ray_ready__.remote() for peer in peers], timeout=120)
        start = time.perf_counter()
        sent_ref = peers[0].send_all.remote(seed, count, window=8)
        recv_ref = peers[1].recv_all.remote(seed, count)
        sent, got = ray.get([sent_ref, recv_ref], timeout=120)
        elapsed = time.perf_counter() - start
        print(
            f"stress: {got['messages']} messages, {got['tensors']} tensors, "
            f"{got['bytes']} bytes in {elapsed:.1f}s"
        )
        assert got["errors"] == [] and got["mismatches"] == 0
        assert got["messages"] == sent["messages"] == count
        assert got["tensors"] == sent["tensors"] > count
        # The generator really produced the edge cases this test claims to cover.
        for dtype in STRESS_DTYPES:
            assert got[str(dtype)] > 50, dtype
        assert got["zero_dim"] > 50 and got["zero_numel"] > 50 and got["values"] > 1000
        ray.get([peer.shutdown.remote() for peer in peers], timeout=60)
    finally:
        for peer in peers:
            ray.kill(peer)
        ray.cloudpickle.unregister_pickle_by_value(module)
