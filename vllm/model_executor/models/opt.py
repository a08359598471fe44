"""OPT (pre-LN like opt-125m, post-LN like opt-350m with project_in/out), holding only this
stage's layers. Learned positions carry OPT's offset of 2."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.attention import KVCache, PagedAttention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.utils import (
    Shard,
    StageLayout,
    check_all_loaded,
    copy_padded_rows,
    copy_weight,
    load_stacked,
    localize_layer_name,
)

_POSITION_OFFSET = 2  # OPT's learned position table starts at index 2 (fairseq legacy).


class OPTAttention(nn.Module):
    """Multi-head attention with biases; the query is scaled before attention like HF OPT.
    With TP, this rank's heads only (column-parallel q/k/v, row-parallel out_proj)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = hidden // total_heads
        self.scaling = self.head_dim**-0.5
        bias = getattr(config, "enable_bias", True)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        # The scale is applied to q up front (HF's order of operations), so attention uses 1.0.
        self.attn = PagedAttention(self.num_heads, self.head_dim, 1.0, self.num_heads)

    def forward(
        self, hidden_states: torch.Tensor, kv_cache: KVCache | None, md: InputMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)  # each [T, hidden]
        return self.out_proj(self.attn(q * self.scaling, k, v, kv_cache, md))


class OPTDecoderLayer(nn.Module):
    """Decoder block; `do_layer_norm_before` picks pre-LN (125m) or post-LN (350m)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        bias = getattr(config, "enable_bias", True)
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, bias=bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias=bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.act = get_act_fn(config.activation_function)

    def forward(
        self, hidden_states: torch.Tensor, kv_cache: KVCache | None, md: InputMetadata
    ) -> torch.Tensor:
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, kv_cache, md)
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + self.fc2(self.act(self.fc1(hidden_states)))
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(nn.Module):
    """Embeddings and project_in (first stage), layers, final norm and project_out (last)."""

    def __init__(self, config: Any, layout: StageLayout) -> None:
        super().__init__()
        self.layout = layout
        proj_dim = config.word_embed_proj_dim
        has_proj = proj_dim != config.hidden_size
        if layout.is_first:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim)
            self.embed_positions = nn.Embedding(
                config.max_position_embeddings + _POSITION_OFFSET, config.hidden_size
            )
            if has_proj:
                self.project_in = nn.Linear(proj_dim, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(layout.num_layers))
        if layout.is_last:
            if config.do_layer_norm_before and not getattr(
                config, "_remove_final_layer_norm", False
            ):
                self.final_layer_norm = nn.LayerNorm(
                    config.hidden_size,
                    elementwise_affine=getattr(config, "layer_norm_elementwise_affine", True),
                )
            if has_proj:
                self.project_out = nn.Linear(config.hidden_size, proj_dim, bias=False)


class OPTForCausalLM(nn.Module):
    """One pipeline stage of an OPT causal LM (lm_head always tied to embed_tokens)."""

    def __init__(self, config: Any, layout: StageLayout) -> None:
        super().__init__()
        self.config = config
        self.layout = layout
        self.model = nn.Module()
        self.model.decoder = OPTDecoder(config, layout)
        if layout.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim)
            if layout.is_first:
                self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: InputMetadata,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T] on the first stage, else hidden_states [T, hidden]; -> [T, hidden]
        ([T, word_embed_proj_dim] after project_out on the last stage)."""
        dec = self.model.decoder
        if self.layout.is_first:
            hidden_states = dec.embed_tokens(input_ids)
            if hasattr(dec, "project_in"):
                hidden_states = dec.project_in(hidden_states)
            hidden_states = hidden_states + dec.embed_positions(positions + _POSITION_OFFSET)
        assert hidden_states is not None
        for layer, kv_cache in zip(dec.layers, kv_caches):
            hidden_states = layer(hidden_states, kv_cache, md)
        if self.layout.is_last:
            if hasattr(dec, "final_layer_norm"):
                hidden_states = dec.final_layer_norm(hidden_states)
            if hasattr(dec, "project_out"):
                hidden_states = dec.project_out(hidden_states)
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden_states [S, proj_dim] -> logits [S, vocab] in float32 on the TP driver; None
        on the other TP ranks."""
        return self.lm_head.compute_logits(hidden_states)

    def weight_shard(self, name: str) -> Shard | None:
        """The part of checkpoint tensor `name` this TP rank loads (None: all of it).
        Positions and project_in/out are small and replicated (as in vLLM)."""
        tp = tpu.tp_size()
        if tp == 1:
            return None
        rank = tpu.tp_rank()
        name = self._canonical(name)
        hidden, ffn = self.config.hidden_size, self.config.ffn_dim
        if name.startswith(("model.decoder.embed_tokens.", "lm_head.")):
            start, _, rows = tpu.vocab_range(self.config.vocab_size, tp, rank)
            return Shard(0, start, rows)
        for part, width in (
            (".q_proj.", hidden),
            (".k_proj.", hidden),
            (".v_proj.", hidden),
            (".fc1.", ffn),
        ):
            if part in name:
                return Shard(0, rank * (width // tp), width // tp)
        for part, width in ((".out_proj.weight", hidden), (".fc2.weight", ffn)):
            if name.endswith(part):
                return Shard(1, rank * (width // tp), width // tp)
        return None

    @staticmethod
    def _canonical(name: str) -> str:
        # Old OPT checkpoints name tensors "decoder.*" without the "model." prefix.
        return "model." + name if name.startswith("decoder.") else name

    def owns_weight(self, name: str) -> bool:
        """Does this stage load the checkpoint tensor `name`?"""
        name = self._canonical(name)
        if localize_layer_name(name, self.layout) is None:
            return False
        if name.startswith("model.decoder.embed_tokens."):
            return self.layout.is_first or self.layout.is_last
        if name.startswith(("model.decoder.embed_positions.", "model.decoder.project_in.")):
            return self.layout.is_first
        if name.startswith(("model.decoder.final_layer_norm.", "model.decoder.project_out.")):
            return self.layout.is_last
        # lm_head is tied to embed_tokens: its own copy in a checkpoint is redundant.
        return not name.startswith("lm_head.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v; lm_head comes from embed_tokens."""
        params = dict(self.named_parameters(remove_duplicate=False))
        hidden = self.config.hidden_size // tpu.tp_size()  # checkpoint tensors arrive sharded
        stacked = [
            ("qkv_proj", "q_proj", 0, hidden),
            ("qkv_proj", "k_proj", hidden, hidden),
            ("qkv_proj", "v_proj", 2 * hidden, hidden),
        ]
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            if not self.owns_weight(raw_name):
                continue
            local = localize_layer_name(self._canonical(raw_name), self.layout)
            assert local is not None
            fused_name = load_stacked(params, local, tensor, stacked)
            if fused_name is not None:
                loaded.add(fused_name)
                continue
            if local == "model.decoder.embed_tokens.weight" and self.layout.is_last:
                copy_padded_rows(params["lm_head.weight"], tensor, raw_name)
                loaded.add("lm_head.weight")
                if not self.layout.is_first:
                    continue
            if local not in params:
                raise ValueError(f"unexpected weight {raw_name!r} in the checkpoint.")
            if local == "model.decoder.embed_tokens.weight":
                copy_padded_rows(params[local], tensor, raw_name)
            else:
                copy_weight(params[local], tensor, raw_name)
            loaded.add(local)
        check_all_loaded(self, loaded)
