"""Tests for PP/TP process groups: real gloo worlds of 2 and 4 spawned processes."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm.distributed import net_utils as net
from vllm.distributed import parallel_state as ps


def _check_layout(rank: int, pp: int, tp: int) -> None:
    """Assert every getter against the layout rank = pp_rank * tp + tp_rank."""
    pp_rank, tp_rank = divmod(rank, tp)
    assert ps.model_parallel_is_initialized()
    assert ps.get_pipeline_model_parallel_rank() == pp_rank
    assert ps.get_pipeline_model_parallel_world_size() == pp
    assert ps.get_tensor_model_parallel_rank() == tp_rank
    assert ps.get_tensor_model_parallel_world_size() == tp
    assert ps.is_pipeline_first_stage() == (pp_rank == 0)
    assert ps.is_pipeline_last_stage() == (pp_rank == pp - 1)
    assert ps.get_pipeline_model_parallel_prev_rank() == ((pp_rank - 1) % pp) * tp + tp_rank
    assert ps.get_pipeline_model_parallel_next_rank() == ((pp_rank + 1) % pp) * tp + tp_rank
    # The groups are real: their sizes and this rank's place in them match the layout.
    assert dist.get_world_size(ps.get_pp_group()) == pp
    assert dist.get_rank(ps.get_pp_group()) == pp_rank
    assert dist.get_world_size(ps.get_tp_group()) == tp
    assert dist.get_rank(ps.get_tp_group()) == tp_rank


def _worker_pp2(rank: int, world: int, port: int) -> None:
    """World of 2: bad sizes raise, pp=2 layout, a collective on the PP group, clean destroy."""
    method = net.get_distributed_init_method("127.0.0.1", port)
    ps.init_distributed_environment(world, rank, method, backend="gloo")
    ps.init_distributed_environment(world, rank, method, backend="gloo")  # idempotent
    with pytest.raises(RuntimeError):
        ps.init_distributed_environment(world + 1, rank, method)
    # Before the groups exist a multi-rank world has no stage layout to answer with.
    with pytest.raises(RuntimeError):
        ps.get_pipeline_model_parallel_rank()
    for pp, tp in [(4, 1), (1, 1), (2, 2)]:
        with pytest.raises(ValueError, match="world_size"):
            ps.initialize_model_parallel(pp, tp)
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(pipeline_parallel_size=2, tensor_parallel_size=1)
    ps.initialize_model_parallel(pipeline_parallel_size=2, tensor_parallel_size=1)  # idempotent
    _check_layout(rank, pp=2, tp=1)
    # A collective over the PP group really reaches both stages: MAX sees rank 1's value.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_pp_group())
    assert t.item() == 1.0
    ps.destroy_model_parallel()
    assert not dist.is_initialized()
    assert not ps.model_parallel_is_initialized()


def _worker_pp4(rank: int, world: int, port_a: int, port_b: int) -> None:
    """World of 4: pp=4 layout, destroy, re-initialise as pp=2 x tp=2 on a new port."""
    ps.init_distributed_environment(
        world, rank, net.get_distributed_init_method("127.0.0.1", port_a), backend="gloo"
    )
    ps.initialize_model_parallel(pipeline_parallel_size=4)
    _check_layout(rank, pp=4, tp=1)
    ps.destroy_model_parallel()
    assert not dist.is_initialized()

    ps.init_distributed_environment(
        world, rank, net.get_distributed_init_method("127.0.0.1", port_b), backend="gloo"
    )
    ps.initialize_model_parallel(pipeline_parallel_size=2, tensor_parallel_size=2)
    _check_layout(rank, pp=2, tp=2)
    ps.destroy_model_parallel()
    assert not dist.is_initialized()


def _worker_silent_peer(rank: int, world: int, port: int, timeout_s: float, out) -> None:
    """Rank 0 receives on the PP group from a peer that is alive and sends nothing and puts
    (error raised, seconds waited) on `out`; the peer stays silent."""
    import time

    method = net.get_distributed_init_method("127.0.0.1", port)
    ps.init_distributed_environment(world, rank, method, backend="gloo", timeout_s=timeout_s)
    ps.initialize_model_parallel(pipeline_parallel_size=2, tensor_parallel_size=1)
    if rank == 0:
        started = time.monotonic()
        try:
            dist.recv(torch.zeros(1), src=1, group=ps.get_pp_group())
            out.put((False, time.monotonic() - started))
        except RuntimeError:
            out.put((True, time.monotonic() - started))
    else:
        time.sleep(timeout_s + 60)  # silent, alive: only the timeout can end the receive


def test_group_receives_end_at_the_worlds_timeout() -> None:
    """A receive on the PP group ends at the world's timeout (3 s here), not after torch's
    30-minute default for new groups (it once waited until the silent peer exited)."""
    ctx = mp.get_context("spawn")
    port = net.get_open_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker_silent_peer, args=(r, 2, port, 3.0, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        raised, waited = out.get(timeout=120)
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
    assert raised and waited < 3.0 + 20, (raised, waited)


def test_open_port_is_free_and_varies() -> None:
    port = net.get_open_port()
    assert 0 < port < 65536
    # Bindable right away, i.e. really free.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))


def test_ip_and_init_method() -> None:
    ip = net.get_ip()
    socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)
    assert net.get_distributed_init_method("10.1.2.3", 29501) == "tcp://10.1.2.3:29501"
    assert net.get_distributed_init_method("::1", 5) == "tcp://[::1]:5"
    assert net.get_distributed_init_method("fe80::1", 29500) == "tcp://[fe80::1]:29500"
    assert net.get_distributed_init_method("[::1]", 7) == "tcp://[::1]:7"  # already bracketed


def test_single_process_answers_as_one_stage() -> None:
    assert not dist.is_initialized()
    assert not ps.model_parallel_is_initialized()
    assert ps.get_pipeline_model_parallel_rank() == 0
    assert ps.get_pipeline_model_parallel_world_size() == 1
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.get_pipeline_model_parallel_prev_rank() == 0
    assert ps.get_pipeline_model_parallel_next_rank() == 0
    with pytest.raises(RuntimeError):
        ps.get_pp_group()
    with pytest.raises(RuntimeError):
        ps.initialize_model_parallel(1, 1)  # needs init_distributed_environment first
    with pytest.raises(ValueError):
        ps.initialize_model_parallel(0, 1)
    ps.destroy_model_parallel()  # harmless when nothing exists
    assert not dist.is_initialized()


def test_two_processes_pp2() -> None:
    mp.spawn(_worker_pp2, args=(2, net.get_open_port()), nprocs=2, join=True)


def test_four_processes_pp4_then_pp2_tp2() -> None:
    mp.spawn(_worker_pp4, args=(4, net.get_open_port(), net.get_open_port()), nprocs=4, join=True)
