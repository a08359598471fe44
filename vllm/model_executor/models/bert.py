"""BERT, holding only this stage's layers: `BertModel` (embeddings: the last hidden states,
pooled by the pooling runner) and `BertForSequenceClassification` (cross-encoder scores and
classes: HF's `BertPooler`, a tanh dense on the [CLS] row, then the classifier).

An encoder-only stage: the embeddings (word + position + token type, LayerNorm) on the first
stage, post-LN blocks with GELU and bidirectional attention within each sequence, the head on
the last stage. No KV cache: the prompt runs once, whole, and the `kv_caches` argument the
decoder stages take is ignored. RoBERTa and XLM-RoBERTa reuse these pieces (roberta.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.encoder_attention import EncoderOnlyAttention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.utils import (
    Shard,
    StageLayout,
    check_all_loaded,
    copy_padded_rows,
    copy_weight,
    load_stacked,
)

_LAYER_RE = re.compile(r"^encoder\.layer\.(\d+)\.")

# Non-persistent buffers some older checkpoints saved: nothing to load.
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def check_encoder_config(config: Any) -> None:
    """ValueError for the BERT-family variants this engine does not run (vLLM refuses the same:
    relative position embeddings, a decoder or cross-attention configuration)."""
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"Only 'absolute' position_embedding_type is supported, got {kind!r}.")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(
            "BERT-family models run here as encoders only: is_decoder and add_cross_attention "
            "must be false in the model's config."
        )


def num_labels_of(config: Any) -> int:
    """The classifier's output count: HF's `num_labels` (the size of `id2label`; 2 by default).
    Stage workers get the config's fields as plain attributes, where only `id2label` is."""
    labels = getattr(config, "num_labels", None)
    if labels is None:
        labels = len(getattr(config, "id2label", None) or {}) or 2
    return int(labels)


def check_ids_below(ids: torch.Tensor, limit: int, what: str, size_name: str) -> None:
    """ValueError naming the ids when one is outside [0, limit): an embedding lookup would
    fail with a bare IndexError deep in the stage."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise ValueError(
            f"{what} must lie in [0, {limit}) ({size_name} = {limit}); got values from "
            f"{int(ids.min())} to {int(ids.max())}."
        )


class BertEmbedding(nn.Module):
    """word + token type + position embeddings, then LayerNorm (HF's BertEmbeddings, in its
    order of additions). With TP the word table is split by vocabulary rows; the position and
    token-type tables are small and replicated."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """input_ids, position_ids, token_type_ids [T] (None: type 0) -> [T, hidden]."""
        check_ids_below(
            position_ids,
            self.position_embeddings.num_embeddings,
            "positions (the prompt is too long for the model)",
            "max_position_embeddings",
        )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        else:
            check_ids_below(
                token_type_ids,
                self.token_type_embeddings.num_embeddings,
                "token_type_ids",
                "type_vocab_size",
            )
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        return self.LayerNorm(embeddings)


class BertSelfAttention(nn.Module):
    """q/k/v with biases fused in one column-parallel matmul (this rank's heads), then
    bidirectional attention scaled by head_size ** -0.5 (HF's `BertSelfAttention`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        if hidden % heads != 0:
            raise ValueError(
                f"The hidden size ({hidden}) is not a multiple of the number of attention "
                f"heads ({heads})."
            )
        head_dim = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads, bias=True)
        self.attn = EncoderOnlyAttention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5)

    def forward(self, hidden_states: torch.Tensor, md: InputMetadata) -> torch.Tensor:
        """[T, hidden] -> [T, hidden / tp] (this rank's heads, concatenated)."""
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)  # each [T, hidden / tp]
        return self.attn(q, k, v, md)


class BertResidualOutput(nn.Module):
    """Row-parallel dense, residual add, LayerNorm: the post-LN end of the attention block
    (HF's BertSelfOutput) and of the feed-forward block (HF's BertOutput)."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_features, hidden, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, in / tp], residual [T, hidden] -> [T, hidden]."""
        return self.LayerNorm(self.dense(hidden_states) + residual)


class BertAttention(nn.Module):
    """HF's BertAttention: `self` (the attention) and `output` (dense, add, LayerNorm)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertResidualOutput(
            config.hidden_size, config.hidden_size, config.layer_norm_eps
        )

    def forward(self, hidden_states: torch.Tensor, md: InputMetadata) -> torch.Tensor:
        return self.output(self.self(hidden_states, md), hidden_states)


class BertIntermediate(nn.Module):
    """Column-parallel dense then the config's activation (GELU for BERT)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size)
        self.act = get_act_fn(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, intermediate / tp]."""
        return self.act(self.dense(hidden_states))


class BertLayer(nn.Module):
    """One post-LN encoder block: attention, then the feed-forward block."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidualOutput(
            config.intermediate_size, config.hidden_size, config.layer_norm_eps
        )

    def forward(self, hidden_states: torch.Tensor, md: InputMetadata) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        attention_output = self.attention(hidden_states, md)
        return self.output(self.intermediate(attention_output), attention_output)


class BertModel(nn.Module):
    """One pipeline stage of a BERT encoder: its layers `encoder.layer[start:end)`, the
    embeddings on the first stage; the last stage returns the last hidden states, which the
    pooling runner pools (CLS by default, as vLLM's BERT embedding models).

    Parameters carry HF's names without the base model's prefix (`bert.` in the checkpoints of
    the heads), and q/k/v fused as `attention.self.qkv_proj`."""

    # The base model's attribute in HF's head classes, stripped from checkpoint names.
    base_model_prefix = "bert"
    # Checkpoint tensors of heads this class does not run (HF's pooler, MLM / NSP heads).
    unused_prefixes: tuple[str, ...] = ("pooler.", "cls.", "lm_head.")

    def __init__(self, config: Any, layout: StageLayout) -> None:
        super().__init__()
        check_encoder_config(config)
        self.config = config
        self.layout = layout
        if layout.is_first:
            self.embeddings = self.make_embeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(config) for _ in range(layout.num_layers))
        if layout.is_last:
            self.make_head(config)

    def make_embeddings(self, config: Any) -> nn.Module:
        return BertEmbedding(config)

    def make_head(self, config: Any) -> None:
        """The last stage's head modules (none for the embedding model)."""

    def embedding_positions(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: InputMetadata
    ) -> torch.Tensor:
        """Position ids [T] for the position table: BERT counts from 0 in each prompt."""
        return positions

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: Any,
        md: InputMetadata,
        hidden_states: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T] (and token_type_ids [T], or None) on the first stage, else
        hidden_states [T, hidden]; -> [T, hidden]. `kv_caches` is ignored (no KV kept)."""
        if self.layout.is_first:
            assert input_ids is not None
            position_ids = self.embedding_positions(input_ids, positions, md)
            hidden_states = self.embeddings(input_ids, position_ids, token_type_ids)
        assert hidden_states is not None
        for layer in self.encoder.layer:
            hidden_states = layer(hidden_states, md)
        return hidden_states

    # ---- weights -------------------------------------------------------------------------

    def canonical_name(self, name: str) -> str:
        """A checkpoint name as this module names it: the base model's prefix dropped, old
        TF-converted LayerNorm names (gamma/beta) as HF renames them."""
        prefix = self.base_model_prefix + "."
        if name.startswith(prefix):
            name = name[len(prefix) :]
        if name.endswith(".gamma"):
            name = name[: -len(".gamma")] + ".weight"
        elif name.endswith(".beta"):
            name = name[: -len(".beta")] + ".bias"
        return name

    def local_name(self, name: str) -> str | None:
        """A canonical name with its global layer index made local; None if another stage
        holds that layer."""
        match = _LAYER_RE.match(name)
        if match is None:
            return name
        index = int(match.group(1))
        if not self.layout.start_layer <= index < self.layout.end_layer:
            return None
        return f"encoder.layer.{index - self.layout.start_layer}." + name[match.end() :]

    def head_prefixes(self) -> tuple[str, ...]:
        """Canonical-name prefixes of the last stage's head tensors."""
        return ()

    def owns_weight(self, name: str) -> bool:
        """Does this stage load the checkpoint tensor `name`?"""
        name = self.canonical_name(name)
        if name in _BUFFERS:
            return False
        if name.startswith(self.head_prefixes()):
            return self.layout.is_last
        if name.startswith(self.unused_prefixes):
            return False
        if name.startswith("embeddings."):
            return self.layout.is_first
        return self.local_name(name) is not None

    def weight_shard(self, name: str) -> Shard | None:
        """The part of checkpoint tensor `name` this TP rank loads (None: all of it): vocabulary
        rows of the word table, head rows of q/k/v and of the intermediate dense (weights and
        biases), input columns of the two output denses. The rest is replicated."""
        tp = tpu.tp_size()
        if tp == 1:
            return None
        rank = tpu.tp_rank()
        name = self.canonical_name(name)
        hidden, ffn = self.config.hidden_size, self.config.intermediate_size
        if name.startswith("embeddings.word_embeddings."):
            start, _, rows = tpu.vocab_range(self.config.vocab_size, tp, rank)
            return Shard(0, start, rows)
        if not name.startswith("encoder.layer."):
            return None
        for part, width in (
            (".attention.self.query.", hidden),
            (".attention.self.key.", hidden),
            (".attention.self.value.", hidden),
            (".intermediate.dense.", ffn),
        ):
            if part in name:
                return Shard(0, rank * (width // tp), width // tp)
        # The attention's output dense first: the feed-forward's name is its suffix.
        for part, width in (
            (".attention.output.dense.weight", hidden),
            (".output.dense.weight", ffn),
        ):
            if name.endswith(part):
                return Shard(1, rank * (width // tp), width // tp)
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (this stage's, this rank's parts), fusing q/k/v."""
        params = dict(self.named_parameters())
        hidden = self.config.hidden_size // tpu.tp_size()  # checkpoint tensors arrive sharded
        stacked = [
            ("qkv_proj", "query", 0, hidden),
            ("qkv_proj", "key", hidden, hidden),
            ("qkv_proj", "value", 2 * hidden, hidden),
        ]
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            if not self.owns_weight(raw_name):
                continue
            local = self.local_name(self.canonical_name(raw_name))
            assert local is not None
            fused = load_stacked(params, local, tensor, stacked)
            if fused is not None:
                loaded.add(fused)
                continue
            if local not in params:
                raise ValueError(f"unexpected weight {raw_name!r} in the checkpoint.")
            if local == "embeddings.word_embeddings.weight":
                copy_padded_rows(params[local], tensor, raw_name)
            else:
                copy_weight(params[local], tensor, raw_name)
            loaded.add(local)
        check_all_loaded(self, loaded)


class BertForSequenceClassification(BertModel):
    """BERT with HF's sequence-classification head on the last stage: `pooler` (dense + tanh
    on the [CLS] row) then `classifier` (hidden -> num_labels). A cross-encoder scores a
    pair encoded as [CLS] a [SEP] b [SEP] with token types 0 / 1."""

    unused_prefixes = ("cls.", "lm_head.")

    def make_head(self, config: Any) -> None:
        hidden = config.hidden_size
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels_of(config))

    def head_prefixes(self) -> tuple[str, ...]:
        return ("pooler.", "classifier.")

    def classify_head(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """cls_hidden [B, hidden] (each sequence's first row) -> logits [B, num_labels],
        float32 (before any activation: the pooling runner applies softmax / sigmoid)."""
        pooled = torch.tanh(self.pooler.dense(cls_hidden))
        return self.classifier(pooled).float()
