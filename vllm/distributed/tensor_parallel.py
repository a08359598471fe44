"""Tensor parallelism inside a stage: the collectives of the TP group and the shard arithmetic
(which rows of a weight, which heads, which vocabulary range belong to a TP rank).

Collectives run on the TP group of ``parallel_state``. With TP = 1 every function is a no-op
that returns its input, so the single-rank path pays nothing. On CUDA (NCCL) the collectives
are issued synchronously on the current (compute) stream: ProcessGroupNCCL makes its own
stream wait on the current one before the collective and the current one wait on it after,
so the rules of the pipeline transport ((a) and (c) in communication.py) hold without a comm
stream of our own, and no tensor outlives its collective unwaited (rule (b)).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm.distributed import parallel_state as ps
from vllm.utils import ceil_div


def tp_size() -> int:
    return ps.get_tensor_model_parallel_world_size()


def tp_rank() -> int:
    return ps.get_tensor_model_parallel_rank()


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact division, with an error naming what did not split evenly."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}.")
    return numerator // denominator


def num_kv_heads_per_rank(total_kv_heads: int, tp: int) -> int:
    """KV heads each TP rank keeps: kv // tp, or 1 (replicated) when kv < tp, as in vLLM."""
    return max(1, total_kv_heads // tp)


def kv_head_start(total_kv_heads: int, tp: int, rank: int) -> int:
    """First KV head of `rank`. With fewer KV heads than ranks, tp / kv consecutive ranks
    share (replicate) one head: rank r keeps head r * kv // tp, which serves exactly the
    query heads r holds (query head h uses KV head h // (heads / kv))."""
    return rank * total_kv_heads // tp


def vocab_range(vocab_size: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(start, end, rows per rank) of `rank`'s vocabulary shard: ceil(vocab / tp) rows each;
    the last shard may be shorter (its padded rows are zero and never selected)."""
    per_rank = ceil_div(vocab_size, tp)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size), per_rank


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group, in place (the row-parallel output projection's reduce)."""
    if tp_size() == 1:
        return x
    dist.all_reduce(x, group=ps.get_tp_group())
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on each rank -> [..., n * tp], the ranks' parts side by side in rank order."""
    tp = tp_size()
    if tp == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x, group=ps.get_tp_group())
    return torch.cat(parts, dim=-1)


def gather_last_dim_to_driver(x: torch.Tensor) -> torch.Tensor | None:
    """[..., n] on each rank -> [..., n * tp] on tp_rank 0 (the driver), None elsewhere.

    Only the driver samples, so the logits shards are gathered there alone (a gather moves
    (tp - 1) / tp of the logits once, an all-gather tp - 1 times that)."""
    tp = tp_size()
    if tp == 1:
        return x
    x = x.contiguous()
    driver = ps.get_tensor_model_parallel_src_rank()
    if tp_rank() == 0:
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.gather(x, parts, dst=driver, group=ps.get_tp_group())
        return torch.cat(parts, dim=-1)
    dist.gather(x, None, dst=driver, group=ps.get_tp_group())
    return None


def slice_for_next_stage(hidden: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """This rank's 1/tp column slice of the (replicated) hidden states, and whether it was
    sliced. After a row-parallel all-reduce every TP rank holds the full hidden states, so
    each sends only its slice to its peer in the next stage, which all-gathers them (vLLM's
    bandwidth saving: tp x less data crosses the stage boundary)."""
    tp = tp_size()
    if tp == 1 or hidden.dim() != 2 or hidden.shape[-1] % tp != 0:
        return hidden, False
    width = hidden.shape[-1] // tp
    return hidden[:, tp_rank() * width : (tp_rank() + 1) * width].contiguous(), True
