"""The LLaMA-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention), holding only this
stage's layers, and the options that make it Mistral, Qwen2, Qwen3 or Phi-3 (their modules set
them: see `DecoderOptions`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from vllm.distributed import tensor_parallel as tpu
from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import KVCache, PagedAttention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary import RotaryEmbedding, get_rope, token_seq_lens
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.llama_decode import DecodeStep, decode_plans
from vllm.model_executor.models.utils import (
    Shard,
    StageLayout,
    check_all_loaded,
    copy_padded_rows,
    copy_weight,
    load_stacked,
    localize_layer_name,
)


@dataclass(frozen=True)
class DecoderOptions:
    """The few ways a LLaMA-style family differs from LLaMA in its decoder layers. (Fused
    checkpoint tensors, Phi-3's `qkv_proj` and `gate_up_proj`, need no option: they load
    under their own names, `weight_shard` cutting each TP rank's rows of every part.)"""

    qkv_bias: bool = False  # biases on q/k/v (Qwen2: these only; LLaMA attention_bias: and o)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before the rope


def head_dim_of(config: Any) -> int:
    """The attention head size: an explicit `head_dim` (Mistral, Qwen3) or hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """The attention window of decoder layer `layer_idx` (None: full attention). Configs with
    `layer_types` (Qwen2/3) window only their "sliding_attention" layers; others (Mistral,
    Phi-3) window every layer when `sliding_window` is set."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return int(window)


class LlamaAttention(nn.Module):
    """Self-attention with a fused q/k/v projection and RoPE; with TP, this rank's heads only
    (column-parallel q/k/v, row-parallel output projection). Options: q/k/v and output biases,
    per-head q/k RMSNorm before the rope (Qwen3), an explicit head_dim, a sliding window.
    Also the attention of MoE families (Mixtral; Qwen3-MoE with qk_norm)."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions | None = None,
        rope: RotaryEmbedding | None = None,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        options = options or DecoderOptions()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = num_kv_heads_of(config)
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_kv_heads, bias=options.qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=options.o_bias)
        self.qk_norm = options.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rope if rope is not None else get_rope(config, self.head_dim)
        # The layer's window (Mistral, Qwen2/3 sliding layers, Phi-3).
        self.sliding_window = sliding_window_of(config, layer_idx)
        self.attn = PagedAttention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=self.sliding_window,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache | None,
        md: InputMetadata,
        rope_seq_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [T, hidden] -> [T, hidden]. rope_seq_lens [T]: each token's sequence
        length, for rope variants that switch on it (`token_seq_lens`)."""
        qkv = self.qkv_proj(hidden_states)  # [T, q + 2kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            # [T, H, D] per head, as HF's q_norm(q_proj(x).view(..., -1, head_dim)).
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k, rope_seq_lens)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, config: Any, options: DecoderOptions | None = None) -> None:
        super().__init__()
        options = options or DecoderOptions()
        bias = options.mlp_bias
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu').")
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

    def __init__(
        self,
        config: Any,
        options: DecoderOptions | None = None,
        rope: RotaryEmbedding | None = None,
        layer_idx: int = 0,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, options, rope, layer_idx)
        # The feed-forward block: LLaMA's MLP unless the family brings its own (MoE).
        self.mlp = mlp if mlp is not None else LlamaMLP(config, options)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def is_plain(self) -> bool:
        """Whether this is LLaMA's layer itself with LLaMA's MLP (not a subclass, not an MoE
        block): the decode fast path (llama_decode.py) may then run it."""
        return type(self) is LlamaDecoderLayer and type(self.mlp) is LlamaMLP

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache | None,
        md: InputMetadata,
        residual: torch.Tensor | None = None,
        rope_seq_lens: torch.Tensor | None = None,
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
        h = self.self_attn(positions, h, kv_cache, md, rope_seq_lens)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embeddings (first stage), this stage's decoder layers, final norm (last stage). The
    layers share one rotary embedding (its caches are per model, not per layer)."""

    def __init__(
        self,
        config: Any,
        layout: StageLayout,
        options: DecoderOptions | None = None,
        make_mlp: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        super().__init__()
        self.layout = layout
        if layout.is_first:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = get_rope(config, head_dim_of(config))
        # make_mlp(global layer index): the layer's feed-forward block (None: LlamaMLP).
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, options, self.rotary_emb, i, make_mlp(i) if make_mlp else None
            )
            for i in range(layout.start_layer, layout.end_layer)
        )
        if layout.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """One pipeline stage of a LLaMA causal LM (Llama 2/3.x: any rope scaling). Families that
    differ only by `DecoderOptions` subclass it and override `decoder_options`."""

    def __init__(self, config: Any, layout: StageLayout) -> None:
        super().__init__()
        self.config = config
        self.layout = layout
        self.options = self.decoder_options(config)
        self.model = LlamaModel(config, layout, self.options, self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if layout.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings and layout.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        """LLaMA's: `attention_bias` on q/k/v/o, `mlp_bias` on the MLP."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """(KV heads this rank caches, head size) of each of this stage's layers."""
        return [
            (layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in self.model.layers
        ]

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        """Hook: the feed-forward block of global layer `layer_idx` (None: LlamaMLP)."""
        return None

    def load_other_weight(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
    ) -> str | None:
        """Hook: load a (stage-local) tensor LLaMA does not know; returns the parameter's
        name if handled, else None."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: InputMetadata,
        hidden_states: torch.Tensor | None = None,
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
        residual: torch.Tensor | None = None
        # Longrope and dynamic NTK need each token's sequence length (once per step). Models
        # that reuse this forward with layers of their own (Gemma) have no shared rope.
        extra = {}
        rope = getattr(self.model, "rotary_emb", None)
        if rope is not None and rope.depends_on_seq_len:
            extra["rope_seq_lens"] = token_seq_lens(positions, md)
        # A small step of decodes only runs each layer's kernels directly (llama_decode.py
        # decides, once per step); anything else takes the modules.
        plans = None if extra else decode_plans(self.model.layers, hidden_states, kv_caches, md)
        if plans is not None:
            step = DecodeStep(positions, md)
            for plan, kv_cache in zip(plans, kv_caches):
                hidden_states, residual = plan.run(step, hidden_states, residual, kv_cache)
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                hidden_states, residual = layer(
                    positions, hidden_states, kv_cache, md, residual, **extra
                )
        if self.layout.is_last:
            if residual is None:  # a stage without layers
                return self.model.norm(hidden_states)
            hidden_states, _ = self.model.norm(hidden_states, residual)
        elif residual is not None:
            # What goes to the next stage is the stream itself, materialised: the same
            # `residual + mlp output` add the last layer would have made.
            hidden_states = residual + hidden_states
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden_states [S, hidden] (already normed) -> logits [S, vocab] in float32 on the
        TP driver (the vocabulary shards gathered); None on the other TP ranks."""
        return self.lm_head.compute_logits(hidden_states)

    def weight_shard(self, name: str) -> Shard | Sequence[Shard] | None:
        """The part of checkpoint tensor `name` this TP rank loads (None: all of it; several
        shards: their parts concatenated, e.g. this rank's q, k and v rows of a fused qkv)."""
        tp = tpu.tp_size()
        if tp == 1:
            return None
        rank = tpu.tp_rank()
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            start, _, rows = tpu.vocab_range(self.config.vocab_size, tp, rank)
            return Shard(0, start, rows)
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_attention_heads, num_kv_heads_of(cfg), head_dim_of(cfg)
        local_q = heads // tp * head_dim
        q_shard = Shard(0, rank * local_q, local_q)
        kv_start = tpu.kv_head_start(kv_heads, tp, rank) * head_dim
        kv_rows = tpu.num_kv_heads_per_rank(kv_heads, tp) * head_dim
        inter = cfg.intermediate_size // tp
        if ".qkv_proj." in name:  # fused checkpoint rows: [q | k | v]
            k_offset = heads * head_dim
            v_offset = k_offset + kv_heads * head_dim
            return [
                q_shard,
                Shard(0, k_offset + kv_start, kv_rows),
                Shard(0, v_offset + kv_start, kv_rows),
            ]
        if ".gate_up_proj." in name:  # fused checkpoint rows: [gate | up]
            return [
                Shard(0, rank * inter, inter),
                Shard(0, cfg.intermediate_size + rank * inter, inter),
            ]
        if ".q_proj." in name:
            return q_shard
        if ".k_proj." in name or ".v_proj." in name:
            return Shard(0, kv_start, kv_rows)
        if ".gate_proj." in name or ".up_proj." in name:
            return Shard(0, rank * inter, inter)
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
        # Any gated MLP with a fused gate/up projection (LLaMA's, Gemma's; not an MoE block).
        gate_up = next(
            (
                la.mlp.gate_up_proj
                for la in self.model.layers
                if isinstance(getattr(la.mlp, "gate_up_proj", None), MergedColumnParallelLinear)
            ),
            None,
        )
        if gate_up is not None:
            inter = gate_up.output_sizes_local[0]
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
