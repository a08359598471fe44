"""Mixture-of-experts feed-forward: a top-k router and SwiGLU experts computed grouped per
expert, with each expert tensor-parallel like an MLP.

Grouped computation: the T x top_k (token, expert) pairs are sorted by expert, so each expert's
tokens are one contiguous block of rows; every expert that received tokens runs one fused
gate/up matmul and one down matmul over its block (no work for tokens not routed to it, no
per-token loop); the outputs, scaled by their routing weights, are scatter-added back to their
tokens one expert after the other. Rows, order and roundings are those of HF's expert loop:
with torch's SiLU the block is bit-equal to HF's, fp32 and bf16 (tests/models/test_moe.py). On CPU
the experts' matrices are prepacked for oneDNN after loading (`FusedMoE.pack`).

Tensor parallelism: expert weights are stored stacked, `w13_weight [E, 2*I/tp, H]` (this rank's
gate rows, then its up rows) and `w2_weight [E, H, I/tp]` (its down columns): the intermediate
dimension of every expert is split like an MLP's (gate/up column-parallel, down row-parallel),
the router is replicated, and the whole block's partial sums are all-reduced once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.packed_weight import PackedWeight, choose_layout
from vllm.model_executor.models.utils import Shard, copy_weight

# Per-expert checkpoint tensors: `experts.<e>.<proj>.weight`, proj named by either family.
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# Stacked tensors as transformers >= 5 holds them in memory: `experts.gate_up_proj`
# [E, 2*I, H] (gate rows, then up rows) and `experts.down_proj` [E, H, I].
_STACKED_RE = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_PART = {
    "w1": "gate",
    "gate_proj": "gate",
    "w3": "up",
    "up_proj": "up",
    "w2": "down",
    "down_proj": "down",
    "gate_up_proj": "gate_up",
}


def topk_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64).

    Softmax over all experts in float32, then the top_k; `renormalize` rescales the chosen
    weights to sum to 1 (Mixtral always; Qwen3-MoE when `norm_topk_prob`)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _scale(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out [N, H] * weights [N] in the weights' dtype, rounded back to out's dtype (as HF)."""
    return (out * weights[:, None]).to(out.dtype)


def packed_linear(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [n, in] times a packed [out, in] weight -> [n, out]."""
    return packed(x)


def grouped_experts(
    x: torch.Tensor,
    w13: Sequence[torch.Tensor] | Sequence[PackedWeight],
    w2: Sequence[torch.Tensor] | Sequence[PackedWeight],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    linear: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2*I, H], w2 [E, H, I], topk_weights / topk_ids [T, k] -> [T, H]:
    sum over each token's k experts of weight * down(silu(gate(x)) * up(x)), each expert's
    matmuls run once over the rows routed to it.

    w13 / w2 may also be per-expert lists of packed weights, with `linear` packed_linear
    (default: F.linear)."""
    linear = linear or F.linear
    num_experts = len(w13)
    num_tokens = topk_ids.shape[0]
    # Pairs listed choice-major ([k, T] flattened) and sorted stably by expert: an expert's
    # rows come in HF's order (by choice rank, then token), so its matmuls see the same rows
    # in the same order as HF's and round alike.
    flat_ids = topk_ids.t().reshape(-1)  # [k*T]
    order = torch.argsort(flat_ids, stable=True)  # [k*T]
    token_of = order % num_tokens  # [k*T] token of each sorted pair
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    rows = x[token_of]  # [k*T, H] grouped by expert
    weights = topk_weights.t().reshape(-1)[order]  # [k*T] in the same order
    result = torch.zeros_like(x)  # [T, H]
    act = SiluAndMul()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        h = linear(rows[start:end], w13[expert])  # [n, 2*I]
        h = linear(act(h), w2[expert])  # [n, H]
        # One scatter-add per expert, in expert order, rounding to x's dtype after each (as
        # HF): a single index_add_ over all pairs may accumulate a token's k rows in float32
        # first (bf16), which rounds differently once top_k > 2.
        result.index_add_(0, token_of[start:end], _scale(h, weights[start:end]))
        start = end
    return result


def per_token_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The same sum, one token and one expert at a time (a reference, and the baseline of
    benchmarks/moe.py): T * top_k pairs of matmuls of one row each."""
    act = SiluAndMul()
    out = torch.zeros_like(x)  # [T, H]
    for t in range(x.shape[0]):
        pairs = sorted(zip(topk_ids[t].tolist(), topk_weights[t]))  # ascending expert order
        for expert, weight in pairs:
            h = F.linear(act(F.linear(x[t : t + 1], w13[expert])), w2[expert])  # [1, H]
            out[t : t + 1] += _scale(h, weight.reshape(1))
    return out


def dense_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The same sum computed densely: every expert on every token, weighted by the routing
    weight (zero for tokens not routed to it). E / top_k times the needed work."""
    act = SiluAndMul()
    num_experts = w13.shape[0]
    # [T, E]: each token's weight for each expert, 0 where not chosen.
    dense_w = torch.zeros(x.shape[0], num_experts, dtype=topk_weights.dtype)
    dense_w.scatter_(1, topk_ids, topk_weights)
    out = torch.zeros_like(x)  # [T, H]
    for expert in range(num_experts):
        h = F.linear(act(F.linear(x, w13[expert])), w2[expert])  # [T, H]
        out += _scale(h, dense_w[:, expert])
    return out


class FusedMoE(nn.Module):
    """The experts of one MoE layer, stacked, this TP rank's shard of each:
    w13_weight [E, 2*I/tp, H] (gate rows then up rows), w2_weight [E, H, I/tp].

    forward(x [T, H], topk_weights, topk_ids) -> [T, H], all-reduced over the TP group when
    `reduce_results` (else this rank's partial sum)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp_size, self.tp_rank = tpu.tp_size(), tpu.tp_rank()
        self.intermediate_local = tpu.divide(
            intermediate_size, self.tp_size, "MoE intermediate size"
        )
        self.reduce_results = reduce_results
        inter = self.intermediate_local
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, inter), requires_grad=False
        )

        # Per-expert packed copies (see pack()), replacing the stacked parameters.
        self._packed: tuple[list[PackedWeight], list[PackedWeight]] | None = None

    def pack(self) -> None:
        """Pack each expert's matrices for the CPU kernel (packed_weight.py; fp32/bf16, called
        by pack_linears after loading): faster expert matmuls at a few rows, as for linear.py's
        layers (docs/PERFORMANCE.md). The stacked parameters are dropped (one copy in
        memory)."""
        layout, _ = choose_layout(self.w13_weight.device, self.w13_weight.dtype)
        if layout is None:  # this dtype runs plain matmuls
            return
        self._packed = (
            [PackedWeight(w, layout) for w in self.w13_weight.detach()],
            [PackedWeight(w, layout) for w in self.w2_weight.detach()],
        )
        del self.w13_weight, self.w2_weight

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self._packed is None:
            out = grouped_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        else:
            w13, w2 = self._packed
            out = grouped_experts(x, w13, w2, topk_weights, topk_ids, packed_linear)
        return tpu.all_reduce(out) if self.reduce_results else out

    def load_weight(self, tensor: torch.Tensor, part: str, expert: int | None, name: str) -> str:
        """Copy a checkpoint tensor into its place; returns the parameter's local name.

        part "gate"/"up"/"down" with `expert`: one expert's matrix, already cut to this rank's
        shard (`moe_weight_shard`). part "gate_up" (expert None): the stacked [E, 2*I, H]
        tensor, whole; this rank's gate and up rows are cut here. part "down" with expert
        None: the stacked [E, H, I/tp], already cut."""
        inter = self.intermediate_local
        if part == "gate_up":
            gate, up = tensor.chunk(2, dim=1)  # [E, I, H] each
            rows = slice(self.tp_rank * inter, (self.tp_rank + 1) * inter)
            copy_weight(self.w13_weight[:, :inter], gate[:, rows], name)
            copy_weight(self.w13_weight[:, inter:], up[:, rows], name)
            return "w13_weight"
        if part == "down":
            target = self.w2_weight if expert is None else self.w2_weight[expert]
            copy_weight(target, tensor, name)
            return "w2_weight"
        assert expert is not None
        offset = 0 if part == "gate" else inter
        copy_weight(self.w13_weight[expert, offset : offset + inter], tensor, name)
        return "w13_weight"


def parse_expert_name(name: str) -> tuple[str, int | None] | None:
    """(part, expert) of an expert checkpoint tensor ("gate", "up", "down" or "gate_up";
    expert None for the stacked tensors), None for any other tensor."""
    match = _EXPERT_RE.search(name)
    if match:
        return _PART[match.group(2)], int(match.group(1))
    match = _STACKED_RE.search(name)
    if match:
        return _PART[match.group(1)], None
    return None


def moe_weight_shard(name: str, intermediate_size: int) -> Shard | None:
    """This TP rank's part of an expert checkpoint tensor (None: all of it, or not an expert
    tensor). Gate/up rows and down columns are split like an MLP's."""
    parsed = parse_expert_name(name)
    tp = tpu.tp_size()
    if parsed is None or tp == 1:
        return None
    part, expert = parsed
    local = tpu.divide(intermediate_size, tp, "MoE intermediate size")
    start = tpu.tp_rank() * local
    if part in ("gate", "up"):
        return Shard(0, start, local)  # [I, H] rows
    if part == "down":
        return Shard(1 if expert is not None else 2, start, local)  # [(E,) H, I] columns
    return None  # stacked gate_up: both halves are cut when loading


class SparseMoeBlock(nn.Module):
    """Router (`gate`: a replicated [E, H] linear) + experts: the feed-forward block of
    Mixtral and Qwen3-MoE decoder layers. x [T, H] -> [T, H] (all-reduced with TP)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        hidden_act: str = "silu",
        weights_in_input_dtype: bool = False,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"MoE hidden_act {hidden_act!r} is not supported.")
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {num_experts}] (the number of experts), "
                f"got {top_k}."
            )
        self.top_k = top_k
        self.renormalize = renormalize
        # Qwen3-MoE rounds the routing weights to the hidden dtype before scaling; Mixtral
        # scales in float32 (differs in bf16 only).
        self.weights_in_input_dtype = weights_in_input_dtype
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        router_logits = self.gate(x)  # [T, E]
        weights, ids = topk_route(router_logits, self.top_k, self.renormalize)  # [T, k]
        if self.weights_in_input_dtype:
            weights = weights.to(x.dtype)
        return self.experts(x, weights, ids)

    def load_weight(self, suffix: str, tensor: torch.Tensor, name: str) -> str | None:
        """Load checkpoint tensor `name` whose part below this block is `suffix` (e.g.
        "gate.weight", "experts.3.w1.weight"); returns the parameter's name below the block,
        None if the name is not one of the block's."""
        if suffix == "gate.weight":
            copy_weight(self.gate.weight, tensor, name)
            return suffix
        parsed = parse_expert_name("." + suffix)
        if parsed is None:
            return None
        part, expert = parsed
        return "experts." + self.experts.load_weight(tensor, part, expert, name)
