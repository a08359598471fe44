"""Process groups for pipeline (PP) and tensor (TP) model parallelism.

Rank layout: ``rank = pp_rank * tp_size + tp_rank``. All ranks of one pipeline stage are
contiguous, so a stage's TP group is ``[pp_rank * tp_size, (pp_rank + 1) * tp_size)`` and
the PP group of ``tp_rank`` is ``{tp_rank, tp_size + tp_rank, 2 * tp_size + tp_rank, ...}``.

When ``torch.distributed`` is not initialised (a single in-process engine, PP = TP = 1) the
getters answer as the only stage, so the single-process engine runs the same stage code.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from vllm.distributed import communication

# Handles created by initialize_model_parallel(); None until then.
_PP_GROUP: dist.ProcessGroup | None = None
_TP_GROUP: dist.ProcessGroup | None = None
# Global ranks of this rank's PP group (ordered by pp_rank) and TP group (ordered by tp_rank).
_PP_GROUP_RANKS: list[int] | None = None
_TP_GROUP_RANKS: list[int] | None = None
# The timeout given to init_distributed_environment: the PP and TP groups get it too
# (torch's new_group() would give them its 30-minute default instead of the world's).
_TIMEOUT: datetime.timedelta | None = None


def init_distributed_environment(
    world_size: int,
    rank: int,
    distributed_init_method: str,
    backend: str | None = None,
    local_rank: int = 0,
    timeout_s: float | None = None,
) -> None:
    """Initialise the default ``torch.distributed`` process group for this rank.

    ``backend`` defaults to ``"nccl"`` when CUDA is available, else ``"gloo"``. Calling it
    again in an already initialised process is a no-op if the world size matches.
    ``timeout_s`` bounds the rendezvous and every blocking receive: a peer that froze makes
    this rank fail with a timeout instead of waiting forever (torch's default is 30 min).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                "torch.distributed is already initialized with world_size="
                f"{dist.get_world_size()}, cannot re-initialize with world_size={world_size}"
            )
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        # NCCL binds a communicator to the current device; set it before the first collective
        # so every rank does not end up on cuda:0.
        torch.cuda.set_device(local_rank)
    global _TIMEOUT
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    _TIMEOUT = timeout
    store = _rendezvous_store(distributed_init_method, rank, world_size, timeout)
    if store is None:
        dist.init_process_group(
            backend=backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            timeout=timeout,
        )
    else:
        dist.init_process_group(
            backend=backend, store=store, world_size=world_size, rank=rank, timeout=timeout
        )


def _rendezvous_store(
    init_method: str, rank: int, world_size: int, timeout: datetime.timedelta | None
) -> dist.TCPStore | None:
    """The rendezvous store of a TCP init method (host and port), listening on `host` only.

    torch's own TCP rendezvous listens on every interface (0.0.0.0 / ::), so anyone who can
    reach the node could read and write the store. Rank 0 binds the listening socket to the
    address the ranks use (127.0.0.1 on one node, the node's address across nodes) and hands
    it to the store. None for another init method (torch's own handling)."""
    from urllib.parse import urlsplit

    url = urlsplit(init_method)  # the inverse of get_distributed_init_method
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        return None
    host, port = url.hostname, url.port
    timeout = timeout or datetime.timedelta(minutes=30)  # torch's default
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    # detach(): the store owns the descriptor from here on (and closes it).
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach())


def initialize_model_parallel(
    pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1
) -> None:
    """Create the PP and TP process groups (collective: every rank must call it).

    Raises ``ValueError`` if ``world_size != pipeline_parallel_size * tensor_parallel_size``.
    """
    global _PP_GROUP, _TP_GROUP, _PP_GROUP_RANKS, _TP_GROUP_RANKS
    if pipeline_parallel_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pipeline_parallel_size}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed_environment() before initialize_model_parallel()")
    world_size = dist.get_world_size()
    if world_size != pipeline_parallel_size * tensor_parallel_size:
        raise ValueError(
            f"world_size ({world_size}) is not equal to pipeline_parallel_size "
            f"({pipeline_parallel_size}) x tensor_parallel_size ({tensor_parallel_size})"
        )
    if model_parallel_is_initialized():
        if (len(_pp_ranks()), len(_tp_ranks())) == (
            pipeline_parallel_size,
            tensor_parallel_size,
        ):
            return
        raise RuntimeError("model parallel groups are already initialized with other sizes")

    rank = dist.get_rank()
    backend = dist.get_backend()
    # new_group() must be called by every rank for every group, in the same order, even for
    # groups the rank is not in; each rank keeps only its own.
    for pp_rank in range(pipeline_parallel_size):
        ranks = list(range(pp_rank * tensor_parallel_size, (pp_rank + 1) * tensor_parallel_size))
        group = dist.new_group(ranks, backend=backend, timeout=_TIMEOUT)
        if rank in ranks:
            _TP_GROUP, _TP_GROUP_RANKS = group, ranks
    for tp_rank in range(tensor_parallel_size):
        ranks = list(range(tp_rank, world_size, tensor_parallel_size))
        group = dist.new_group(ranks, backend=backend, timeout=_TIMEOUT)
        if rank in ranks:
            _PP_GROUP, _PP_GROUP_RANKS = group, ranks


def model_parallel_is_initialized() -> bool:
    """True once initialize_model_parallel() has created the groups."""
    return _PP_GROUP is not None and _TP_GROUP is not None


def _single_process() -> bool:
    """True when this process may answer as the only stage (no groups exist yet).

    Without groups, a multi-rank world has no defined stage layout, so asking is a bug.
    """
    if model_parallel_is_initialized():
        return False
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    raise RuntimeError(
        "model parallel groups are not initialized; call initialize_model_parallel()"
    )


def _pp_ranks() -> list[int]:
    if _PP_GROUP_RANKS is None:
        raise RuntimeError("pipeline model parallel group is not initialized")
    return _PP_GROUP_RANKS


def _tp_ranks() -> list[int]:
    if _TP_GROUP_RANKS is None:
        raise RuntimeError("tensor model parallel group is not initialized")
    return _TP_GROUP_RANKS


def get_pp_group() -> dist.ProcessGroup:
    """The pipeline-parallel group of this rank (same tp_rank, all stages)."""
    if _PP_GROUP is None:
        raise RuntimeError("pipeline model parallel group is not initialized")
    return _PP_GROUP


def get_tp_group() -> dist.ProcessGroup:
    """The tensor-parallel group of this rank (same stage, all tp ranks)."""
    if _TP_GROUP is None:
        raise RuntimeError("tensor model parallel group is not initialized")
    return _TP_GROUP


def get_pipeline_model_parallel_rank() -> int:
    """This rank's stage index in [0, pp_size)."""
    if _single_process():
        return 0
    return _pp_ranks().index(dist.get_rank())


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    if _single_process():
        return 1
    return len(_pp_ranks())


def get_tensor_model_parallel_rank() -> int:
    """This rank's index inside its stage's TP group."""
    if _single_process():
        return 0
    return _tp_ranks().index(dist.get_rank())


def get_tensor_model_parallel_world_size() -> int:
    """Number of TP ranks per stage."""
    if _single_process():
        return 1
    return len(_tp_ranks())


def is_pipeline_first_stage() -> bool:
    """True on the stage that owns the embeddings and receives the scheduler output."""
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    """True on the stage that owns the final norm, lm_head and sampler."""
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_pipeline_model_parallel_prev_rank() -> int:
    """GLOBAL rank of the previous stage with the same tp_rank (wraps around, as in vLLM)."""
    if _single_process():
        return dist.get_rank() if dist.is_initialized() else 0
    pp_rank = get_pipeline_model_parallel_rank()
    return _pp_ranks()[(pp_rank - 1) % len(_pp_ranks())]


def get_pipeline_model_parallel_next_rank() -> int:
    """GLOBAL rank of the next stage with the same tp_rank (wraps around, as in vLLM)."""
    if _single_process():
        return dist.get_rank() if dist.is_initialized() else 0
    pp_rank = get_pipeline_model_parallel_rank()
    return _pp_ranks()[(pp_rank + 1) % len(_pp_ranks())]


def destroy_model_parallel() -> None:
    """Destroy the PP/TP groups and the default process group (safe to call repeatedly)."""
    global _PP_GROUP, _TP_GROUP, _PP_GROUP_RANKS, _TP_GROUP_RANKS
    if dist.is_initialized():
        for group in (_PP_GROUP, _TP_GROUP):
            if group is not None:
                dist.destroy_process_group(group)
    _PP_GROUP = _TP_GROUP = None
    _PP_GROUP_RANKS = _TP_GROUP_RANKS = None
    if dist.is_initialized():
        # Destroying the default group also tears down the TCP store, so a later
        # init_distributed_environment() in this process starts clean.
        dist.destroy_process_group()
    # The chunk receives posted on the old groups go with them (after, not before: gloo
    # could still be writing into their buffers until the groups are closed).
    communication.forget_channels()


def get_tensor_model_parallel_src_rank() -> int:
    """GLOBAL rank of this stage's TP driver (tp_rank 0): it samples and returns the output."""
    if _single_process():
        return dist.get_rank() if dist.is_initialized() else 0
    return _tp_ranks()[0]
