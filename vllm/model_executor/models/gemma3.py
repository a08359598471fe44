"""Gemma 3 text (`Gemma3ForCausalLM`, `Gemma3TextConfig`), on Gemma 2's pieces (gemma2.py).

What Gemma 3 changes, as HF does: per-head q and k RMSNorm (1 + w) before rope; local and
global layers in the `layer_types` pattern (5 local : 1 global by default), each type with
its own rope (`rope_parameters["sliding_attention"]`, i.e. the old rope_local_base_freq, for
local layers; `rope_parameters["full_attention"]` for global ones); no attention soft-cap (HF's
Gemma 3 attention ignores attn_logit_softcapping); the final soft-cap only when configured.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.gemma2 import (
    SLIDING,
    Gemma2ForCausalLM,
    GemmaLayerSpec,
    layer_type,
    split_rope_params,
)

# HF Gemma3TextConfig's defaults for configs that predate per-type rope_parameters.
_GLOBAL_THETA = 1_000_000.0
_LOCAL_THETA = 10_000.0


def gemma3_layer_spec(config: Any, layer_idx: int) -> GemmaLayerSpec:
    """Gemma 3: `layer_types` (or every sliding_window_pattern-th layer global), the rope of
    the layer's type, q/k norms, no score soft-cap."""
    kind = layer_type(config, layer_idx, getattr(config, "sliding_window_pattern", None) or 6)
    local = kind == SLIDING
    params = getattr(config, "rope_parameters", None) or {}
    if kind in params:  # transformers >= 5: one rope dict per layer type
        theta, scaling = split_rope_params(params[kind], _LOCAL_THETA if local else _GLOBAL_THETA)
    elif local:  # older configs: rope_local_base_freq, no scaling on local layers
        theta = float(getattr(config, "rope_local_base_freq", None) or _LOCAL_THETA)
        scaling = {}
    else:
        flat = params or getattr(config, "rope_scaling", None)
        theta, scaling = split_rope_params(
            flat, getattr(config, "rope_theta", None) or _GLOBAL_THETA
        )
    return GemmaLayerSpec(
        sliding_window=config.sliding_window if local else None,
        rope_theta=theta,
        rope_scaling=scaling,
        attn_soft_cap=None,
        qk_norm=True,
    )


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """One pipeline stage of a Gemma 3 text causal LM (see Gemma2ForCausalLM)."""

    @staticmethod
    def layer_spec(config: Any, layer_idx: int) -> GemmaLayerSpec:
        return gemma3_layer_spec(config, layer_idx)
