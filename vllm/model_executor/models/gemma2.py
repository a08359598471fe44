"""Gemma 2, holding only this stage's layers; its pieces also build Gemma 3 (gemma3.py).

Differences from LLaMA, all HF's: embeddings scaled by sqrt(hidden_size) (in the embedding
dtype); RMSNorm applied as (1 + w) in float32; a norm after attention and around the MLP
(pre- and post-feed-forward) besides the input norm; GeLU-tanh gated MLP; scores scaled by
query_pre_attn_scalar ** -0.5 and soft-capped (attn_logit_softcapping); local sliding-window
layers alternating with global ones (`layer_types`); final logits soft-capped
(final_logit_softcapping) on the last stage, so prompt logprobs see them capped too.
Weight names, TP sharding and loading are LLaMA's (LlamaForCausalLM's methods are reused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.layers.activation import GeluAndMul
from vllm.model_executor.layers.attention import KVCache, PagedAttention, soft_cap
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
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
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.utils import StageLayout

SLIDING = "sliding_attention"

# HF activation names Gemma configs use -> F.gelu's `approximate`.
_GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class GemmaLayerSpec:
    """What differs between the decoder layers of one Gemma model: local (windowed) or global
    attention, its rope, its score soft-cap, and q/k norms (Gemma 3)."""

    sliding_window: int | None
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    attn_soft_cap: float | None = None
    qk_norm: bool = False


def split_rope_params(params: dict[str, Any] | None, theta: float) -> tuple[float, dict]:
    """(rope_theta, the rest) of one rope dict; transformers >= 5 keeps rope_theta inside it,
    older configs at top level (`theta`, the fallback)."""
    rope = dict(params or {})
    return float(rope.pop("rope_theta", None) or theta), rope


def layer_type(config: Any, layer_idx: int, sliding_every: int) -> str:
    """`config.layer_types[layer_idx]` (global index), or, for configs without the list, HF's
    default pattern: every `sliding_every`-th layer global, the others sliding."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[layer_idx]
    return SLIDING if (layer_idx + 1) % sliding_every else "full_attention"


def check_causal(config: Any) -> None:
    """These modules are causal LMs: bidirectional Gemma (embedding models) is refused."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported for causal LMs.")


def gemma2_layer_spec(config: Any, layer_idx: int) -> GemmaLayerSpec:
    """Gemma 2: even layers local (window `sliding_window`), odd layers global; one rope."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    theta, scaling = split_rope_params(params, getattr(config, "rope_theta", None) or 10000.0)
    local = layer_type(config, layer_idx, 2) == SLIDING
    return GemmaLayerSpec(
        sliding_window=config.sliding_window if local else None,
        rope_theta=theta,
        rope_scaling=scaling,
        attn_soft_cap=getattr(config, "attn_logit_softcapping", None),
    )


class GemmaMLP(nn.Module):
    """GeLU gated feed-forward with a fused gate/up projection (LLaMA's shape, Gemma's act)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        inter = config.intermediate_size
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in _GELU_APPROXIMATE:
            raise ValueError(
                f"hidden_activation {act!r} is not supported for Gemma; "
                f"supported: {sorted(_GELU_APPROXIMATE)}."
            )
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=False
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False)
        self.act = GeluAndMul(_GELU_APPROXIMATE[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    """Self-attention with fused q/k/v, optional per-head q/k RMSNorm (before rope), rope,
    and the layer's window and soft-cap; with TP, this rank's heads only."""

    def __init__(self, config: Any, spec: GemmaLayerSpec) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_kv_heads, bias=bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, spec.rope_theta, spec.rope_scaling
        )
        scalar = getattr(config, "query_pre_attn_scalar", None) or self.head_dim
        self.attn = PagedAttention(
            self.num_heads,
            self.head_dim,
            scalar**-0.5,
            self.num_kv_heads,
            sliding_window=spec.sliding_window,
            logits_soft_cap=spec.attn_soft_cap,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache | None,
        md: InputMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, q + 2kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            tokens = hidden_states.shape[0]
            # Per head: [T*H, D] rows, back to [T, H*D] (fresh, contiguous tensors).
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(tokens, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(tokens, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x))).

    The residual stream is carried as in LlamaDecoderLayer: a layer returns (its last output,
    residual) unadded, and the next norm adds them (fused, in place, by the C++ kernel)."""

    def __init__(self, config: Any, spec: GemmaLayerSpec) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(config, spec)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache | None,
        md: InputMetadata,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [T, hidden] and residual as in LlamaDecoderLayer.forward; returns
        (this layer's post-feed-forward-norm output, residual), the stream being their sum."""
        if residual is None:
            residual = hidden_states
            h = self.input_layernorm(hidden_states)
        else:
            h, residual = self.input_layernorm(hidden_states, residual)
        h = self.self_attn(positions, h, kv_cache, md)
        h = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


class ScaledEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding times sqrt(hidden_size), the factor rounded to the weight's
    dtype first (HF Gemma2TextScaledWordEmbedding)."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__(vocab_size, dim)
        self.embed_scale = dim**0.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, dim]."""
        scale = torch.tensor(self.embed_scale, dtype=self.weight.dtype)
        return super().forward(ids) * scale


class GemmaModel(nn.Module):
    """Scaled embeddings (first stage), this stage's decoder layers (each built from the spec
    of its global index), final norm (last stage)."""

    def __init__(
        self,
        config: Any,
        layout: StageLayout,
        layer_spec: Callable[[Any, int], GemmaLayerSpec],
    ) -> None:
        super().__init__()
        self.layout = layout
        if layout.is_first:
            self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, layer_spec(config, layout.start_layer + i))
            for i in range(layout.num_layers)
        )
        if layout.is_last:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """One pipeline stage of a Gemma 2 causal LM. forward, TP sharding and weight loading are
    LlamaForCausalLM's (same tensor names; the lm_head, tied by default, is loaded from
    embed_tokens on the last stage); compute_logits adds the final soft-cap."""

    @staticmethod
    def layer_spec(config: Any, layer_idx: int) -> GemmaLayerSpec:
        return gemma2_layer_spec(config, layer_idx)

    def __init__(self, config: Any, layout: StageLayout) -> None:
        # LlamaForCausalLM.__init__ would build LLaMA layers: set up the same attributes here.
        nn.Module.__init__(self)
        check_causal(config)
        self.config = config
        self.layout = layout
        self.model = GemmaModel(config, layout, self.layer_spec)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.final_logit_softcapping: float | None = getattr(
            config, "final_logit_softcapping", None
        )
        if layout.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings and layout.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden_states [S, hidden] (normed) -> soft-capped logits [S, vocab] float32 on the TP
        driver, None elsewhere. Sampling and prompt logprobs both start from these."""
        logits = self.lm_head.compute_logits(hidden_states)
        if logits is None:
            return None
        return soft_cap(logits, self.final_logit_softcapping)
