"""Vocabulary-parallel embedding and lm_head: each TP rank holds ceil(vocab / tp) rows.

The embedding looks up the ids in its own range (zero elsewhere) and all-reduces; the lm_head
computes its slice of the logits and gathers them on the TP driver (tp_rank 0), the only rank
that samples. With TP = 1 both are the plain embedding / matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.layers.linear import ParallelLinearBase
from vllm.model_executor.layers.quantization.gguf import GGUFWeight


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows split over the TP ranks."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.end, rows = tpu.vocab_range(vocab_size, tpu.tp_size(), tpu.tp_rank())
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)
        # --quantization gguf: the rows as GGUF blocks instead of `weight` (set after loading).
        self.quant: GGUFWeight | None = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of this shard -> [T, dim] (GGUF blocks: only those rows dequantized)."""
        if self.quant is None:
            return F.embedding(ids, self.weight)
        return self.quant.rows(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, dim]."""
        if tpu.tp_size() == 1:
            return self._lookup(ids)
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = self._lookup(local)
        out.masked_fill_(~mine[:, None], 0)
        return tpu.all_reduce(out)


class ParallelLMHead(ParallelLinearBase):
    """The lm_head with its vocabulary rows split like VocabParallelEmbedding (so a tied head
    shares the embedding's shard). Under --quantization gguf it gets the file's blocks after
    loading (quantization.gguf.quantize_lm_head), not while loading."""

    QUANTIZABLE = False

    def __init__(self, vocab_size: int, dim: int) -> None:
        self.vocab_size = vocab_size
        start, end, rows = tpu.vocab_range(vocab_size, tpu.tp_size(), tpu.tp_rank())
        self.start, self.end = start, end
        super().__init__(dim, rows, False, 0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [S, dim] -> logits [S, vocab] float32 on the TP driver; None on other ranks."""
        logits = tpu.gather_last_dim_to_driver(self.local_matmul(hidden, None))
        if logits is None:
            return None
        if logits.shape[-1] != self.vocab_size:  # the last shard's padding rows
            logits = logits[:, : self.vocab_size]
        return logits.float()
