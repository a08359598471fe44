"""LLaMA (RMSNorm, RoPE, SwiGLU, grouped-query attention), holding only this stage's layers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from torch import nn

from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import KVCache, PagedAttention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary import RotaryEmbedding
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
from vllm.model_executor.parallel_utils import tensor_parallel as tpu


class LlamaAttention(nn.Module):
    """Self-attention with a fused q/k/v projection and RoPE; with TP, this rank's heads only
    (column-parallel q/k/v, row-parallel output projection)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_kv_heads, bias=bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=bias)
        # transformers >= 5 keeps rope_theta inside rope_parameters; older configs at top level.
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope = dict(rope or {})
        theta = rope.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, theta, rope
        )
        self.attn = PagedAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: Optional[KVCache],
        md: InputMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, q + 2kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"LLaMA hidden_act {config.hidden_act!r} is not supported.")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream is carried vLLM-style: a layer returns (mlp output, residual) without
    adding them; the next layer's input norm adds them (fused with the norm, in place, by the
    C++ kernel), and so does the final norm. The sums and their roundings are those of the
    plain `x + f(x)` (one add of the same two operands), so results do not change.
    """

    def __init__(self, config: Any, mlp: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        # The feed-forward block: LLaMA's MLP unless the family brings its own (MoE).
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: Optional[KVCache],
        md: InputMetadata,
        residual: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [T, hidden]: the stream itself (residual None: first layer of the
        stage) or the previous layer's MLP output to add to `residual` [T, hidden].
        Returns (this layer's MLP output, residual), the stream being their sum.

        `residual` (and, when given, hidden_states) may be overwritten in place.
        """
        if residual is None:
            residual = hidden_states
            h = self.input_layernorm(hidden_states)
        else:
            h, residual = self.input_layernorm(hidden_states, residual)
        h = self.self_attn(positions, h, kv_cache, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embeddings (first stage), this stage's decoder layers, final norm (last stage)."""

    def __init__(
        self,
        config: Any,
        layout: StageLayout,
        make_mlp: Optional[Callable[[int], Optional[nn.Module]]] = None,
    ) -> None:
        super().__init__()
        self.layout = layout
        if layout.is_first:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # make_mlp(global layer index): the layer's feed-forward block (None: LlamaMLP).
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, make_mlp(i) if make_mlp else None)
            for i in range(layout.start_layer, layout.end_layer)
        )
        if layout.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """One pipeline stage of a LLaMA causal LM."""

    def __init__(self, config: Any, layout: StageLayout) -> None:
        super().__init__()
        self.config = config
        self.layout = layout
        self.model = LlamaModel(config, layout, self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if layout.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings and layout.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, layer_idx: int) -> Optional[nn.Module]:
        """Hook: the feed-forward block of global layer `layer_idx` (None: LlamaMLP)."""
        return None

    def load_other_weight(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
    ) -> Optional[str]:
        """Hook: load a (stage-local) tensor LLaMA does not know; returns the parameter's
        name if handled, else None."""
        return None

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: InputMetadata,
        hidden_states: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """input_ids [T] on the first stage, else hidden_states [T, hidden] (the residual
        stream from the previous stage; not modified); -> [T, hidden]: the final norm's output
        on the last stage, else the residual stream for the next stage."""
        if self.layout.is_first:
            hidden_states = self.model.embed_tokens(input_ids)  # a fresh tensor
        else:
            assert hidden_states is not None
            # The layers update the residual stream in place (fused add + norm): work on a
            # copy, not on the caller's tensor (one [T, hidden] copy per step).
            hidden_states = hidden_states.clone()
        residual: Optional[torch.Tensor] = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden_states, residual = layer(positions, hidden_states, kv_cache, md, residual)
        if self.layout.is_last:
            if residual is None:  # a stage without layers
                return self.model.norm(hidden_states)
            hidden_states, _ = self.model.norm(hidden_states, residual)
        elif residual is not None:
            # What goes to the next stage is the stream itself, materialised: the same
            # `residual + mlp output` add the last layer would have made.
            hidden_states = residual + hidden_states
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden_states [S, hidden] (already normed) -> logits [S, vocab] in float32 on the
        TP driver (the vocabulary shards gathered); None on the other TP ranks."""
        return self.lm_head.compute_logits(hidden_states)

    def weight_shard(self, name: str) -> Optional[Shard]:
        """The part of checkpoint tensor `name` this TP rank loads (None: all of it)."""
        tp = tpu.tp_size()
        if tp == 1:
            return None
        rank = tpu.tp_rank()
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            start, _, rows = tpu.vocab_range(self.config.vocab_size, tp, rank)
            return Shard(0, start, rows)
        cfg = self.config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if ".q_proj." in name:
            local = heads // tp * head_dim
            return Shard(0, rank * local, local)
        if ".k_proj." in name or ".v_proj." in name:
            start = tpu.kv_head_start(kv_heads, tp, rank) * head_dim
            return Shard(0, start, tpu.num_kv_heads_per_rank(kv_heads, tp) * head_dim)
        if ".gate_proj." in name or ".up_proj." in name:
            local = cfg.intermediate_size // tp
            return Shard(0, rank * local, local)
        if name.endswith((".o_proj.weight", ".down_proj.weight")):
            width = (heads * head_dim if ".o_proj." in name else cfg.intermediate_size) // tp
            return Shard(1, rank * width, width)
        return None  # norms, row-parallel biases: replicated

    def owns_weight(self, name: str) -> bool:
        """Does this stage load the checkpoint tensor `name`? (lets loaders skip the rest)"""
        if localize_layer_name(name, self.layout) is None:
            return False
        if name.startswith("model.embed_tokens."):
            return self.layout.is_first or (self.layout.is_last and self.tie_word_embeddings)
        if name.startswith("model.norm.") or name.startswith("lm_head."):
            return self.layout.is_last
        return "rotary_emb.inv_freq" not in name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up; tied lm_head from embed_tokens."""
        params = dict(self.named_parameters(remove_duplicate=False))
        attn = self.model.layers[0].self_attn if len(self.model.layers) else None
        stacked: list[tuple[str, str, int, int]] = []
        if attn is not None:
            # This rank's sizes: checkpoint tensors arrive already cut to its shard.
            q, kv = attn.q_size, attn.kv_size
            stacked = [
                ("qkv_proj", "q_proj", 0, q),
                ("qkv_proj", "k_proj", q, kv),
                ("qkv_proj", "v_proj", q + kv, kv),
            ]
        mlp = next((la.mlp for la in self.model.layers if isinstance(la.mlp, LlamaMLP)), None)
        if mlp is not None:
            inter = mlp.gate_up_proj.output_sizes_local[0]
            stacked += [
                ("gate_up_proj", "gate_proj", 0, inter),
                ("gate_up_proj", "up_proj", inter, inter),
            ]
        loaded: set[str] = set()
        for name, tensor in weights:
            if not self.owns_weight(name):
                continue
            local = localize_layer_name(name, self.layout)
            assert local is not None
            fused_name = self.load_other_weight(params, local, tensor) or load_stacked(
                params, local, tensor, stacked
            )
            if fused_name is not None:
                loaded.add(fused_name)
                continue
            if local == "model.embed_tokens.weight" and self.layout.is_last:
                if self.tie_word_embeddings:
                    copy_padded_rows(params["lm_head.weight"], tensor, name)
                    loaded.add("lm_head.weight")
                if not self.layout.is_first:
                    continue
            if local not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint.")
            if local in ("model.embed_tokens.weight", "lm_head.weight"):
                copy_padded_rows(params[local], tensor, name)
            else:
                copy_weight(params[local], tensor, name)
            loaded.add(local)
        check_all_loaded(self, loaded)
