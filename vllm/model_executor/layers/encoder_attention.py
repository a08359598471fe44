"""Bidirectional self-attention of encoder-only models (BERT, RoBERTa, XLM-RoBERTa).

Every token of a sequence sees every token of the same sequence and none of another: the
batch is packed as the engine packs prefills (sequences back to back, `InputMetadata`'s
prefill lengths), so this is HF's `BertSelfAttention` with an `attention_mask` that keeps each
sequence's own tokens and hides the padding of the others. No KV cache: an encoder runs each
whole prompt in one step and keeps nothing for later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.input_metadata import InputMetadata


def check_whole_prompts(md: InputMetadata) -> None:
    """ValueError unless the step holds only whole prompts: an encoder cannot decode, and a
    chunk or a cached prefix would hide part of the sequence from its own tokens."""
    if md.num_decode_tokens:
        raise ValueError(
            f"encoder-only attention got {md.num_decode_tokens} decode tokens: encoder-only "
            "models run each prompt once and never decode."
        )
    if any(md.prefill_context_list):
        raise ValueError(
            "encoder-only attention got a prompt continuing after cached tokens (a chunked "
            "prefill or a prefix-cache hit): encoder-only models need the whole prompt in one "
            "step (chunked prefill and prefix caching do not apply to them)."
        )


def length_groups(seq_lens: list[int]) -> dict[int, list[int]]:
    """length -> the start offsets of the packed sequences of that length, in batch order."""
    groups: dict[int, list[int]] = {}
    start = 0
    for length in seq_lens:
        groups.setdefault(length, []).append(start)
        start += length
    return groups


def encoder_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Full attention of each packed sequence over itself. query/key/value [T, H, D] with
    T = sum(seq_lens); returns [T, H, D].

    Sequences of one length go through SDPA together as a [B, H, L, D] batch with no mask
    (exact: nothing to pad); lengths that differ run apart. 4-D inputs take torch's CPU flash
    kernel, which never builds the [L, L] score matrix."""
    if sum(seq_lens) != query.shape[0]:
        raise ValueError(
            f"encoder attention: the prompt lengths {seq_lens} add up to {sum(seq_lens)} "
            f"tokens, the batch has {query.shape[0]}."
        )
    out = torch.empty_like(query)
    for length, starts in length_groups(seq_lens).items():
        if len(starts) == 1:
            rows: slice | torch.Tensor = slice(starts[0], starts[0] + length)
        else:
            # [B * L] flat row indices of the group's tokens, sequence by sequence.
            base = torch.tensor(starts, device=query.device)[:, None]
            rows = (base + torch.arange(length, device=query.device)).reshape(-1)
        batch = len(starts)

        def heads_first(x: torch.Tensor, rows=rows, batch=batch, length=length) -> torch.Tensor:
            # [B * L, H, D] -> [B, H, L, D]
            return x[rows].reshape(batch, length, x.shape[1], x.shape[2]).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            heads_first(query), heads_first(key), heads_first(value), scale=scale
        )  # [B, H, L, D]
        out[rows] = o.transpose(1, 2).reshape(batch * length, query.shape[1], query.shape[2])
    return out


class EncoderOnlyAttention(nn.Module):
    """Multi-head bidirectional attention within each sequence of the batch (this TP rank's
    heads). Takes the decoder layers' `kv_cache` argument and ignores it: an encoder keeps no
    KV between steps."""

    def __init__(self, num_heads: int, head_size: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_size={self.head_size}, scale={self.scale}"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        md: InputMetadata,
    ) -> torch.Tensor:
        """query/key/value [T, H*D] -> [T, H*D]."""
        check_whole_prompts(md)
        num_tokens = query.shape[0]
        shape = (num_tokens, self.num_heads, self.head_size)
        out = encoder_attention(
            query.view(shape), key.view(shape), value.view(shape), md.prefill_lens, self.scale
        )
        return out.view(num_tokens, self.num_heads * self.head_size)
