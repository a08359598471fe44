"""RoBERTa and XLM-RoBERTa: BERT's encoder (bert.py) with RoBERTa's positions and head.

Positions follow HF's `create_position_ids_from_input_ids`: within each prompt, the n-th
token that is not the padding token sits at position padding_idx + n (counting from 1), a
padding token at padding_idx; a prompt without padding tokens thus runs from padding_idx + 1.
Token types are all 0 (`type_vocab_size` 1: the tokenizer's pair encoding gives none).
`*ForSequenceClassification` uses HF's RobertaClassificationHead (dense + tanh on the <s> row,
then out_proj); the base model's pooler is not part of it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.layers.encoder_attention import check_whole_prompts
from vllm.model_executor.models.bert import BertModel, num_labels_of


def roberta_position_ids(
    input_ids: torch.Tensor, seq_lens: list[int], padding_idx: int
) -> torch.Tensor:
    """input_ids [T] of prompts packed back to back (lengths `seq_lens`) -> position ids [T],
    counted within each prompt as HF counts them (see the module docstring)."""
    not_pad = (input_ids != padding_idx).long()  # [T]
    running = not_pad.cumsum(0)  # [T]: non-padding tokens up to here, across prompts
    lens = torch.tensor(seq_lens, dtype=torch.long, device=input_ids.device)  # [B]
    ends = lens.cumsum(0)
    # Non-padding tokens before each prompt's first token, subtracted to restart the count.
    before = torch.cat([running.new_zeros(1), running[ends[:-1] - 1]])  # [B]
    within = running - before.repeat_interleave(lens)
    return within * not_pad + padding_idx


class RobertaModel(BertModel):
    """One pipeline stage of a RoBERTa encoder (embeddings: CLS pooling by default, as vLLM's
    RoBERTa embedding models)."""

    base_model_prefix = "roberta"

    def embedding_positions(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: InputMetadata
    ) -> torch.Tensor:
        check_whole_prompts(md)  # the count restarts with each whole prompt
        return roberta_position_ids(input_ids, md.prefill_lens, self.config.pad_token_id)


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa with HF's classification head on the last stage: `classifier.dense` + tanh on
    the <s> row, then `classifier.out_proj` (hidden -> num_labels)."""

    unused_prefixes = ("pooler.", "lm_head.")

    def make_head(self, config: Any) -> None:
        hidden = config.hidden_size
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(hidden, hidden)
        self.classifier.out_proj = nn.Linear(hidden, num_labels_of(config))

    def head_prefixes(self) -> tuple[str, ...]:
        return ("classifier.",)

    def classify_head(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """cls_hidden [B, hidden] (each sequence's first row) -> logits [B, num_labels],
        float32 (before any activation)."""
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(cls_hidden))).float()


class XLMRobertaModel(RobertaModel):
    """XLM-RoBERTa: RoBERTa's architecture with a larger vocabulary (same checkpoint names)."""


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    """XLM-RoBERTa cross-encoders and classifiers (e.g. bge-reranker-base's architecture)."""
