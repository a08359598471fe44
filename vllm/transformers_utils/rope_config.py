"""A model config's RoPE parameters, normalised: transformers >= 5 keeps them in
`rope_parameters` (with `rope_theta` inside), older configs in `rope_scaling` with `rope_theta`
and `partial_rotary_factor` at the top level. Torch-free: `vllm.config` derives the context
length from them without loading torch; `layers/rotary.py` builds the caches.
"""

from __future__ import annotations

from typing import Any

# The rope types the engine computes (transformers' ROPE_INIT_FUNCTIONS names, plus "default").
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Types whose parameters name the pretraining context length.
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def rope_type_of(params: dict[str, Any] | None) -> str:
    """The rope type a parameter dict names ("default" when none). "su" is Phi-3's old name for
    longrope (transformers maps it the same way)."""
    params = params or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return "longrope" if rope_type == "su" else str(rope_type)


def check_rope_type(rope_type: str) -> None:
    """ValueError naming an unsupported rope type and the supported ones."""
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported rope types: "
            f"{list(SUPPORTED_ROPE_TYPES)}."
        )


def get_rope_parameters(config: Any, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of the config's rope parameters with `rope_type`, `rope_theta` and
    `partial_rotary_factor` always set, and `original_max_position_embeddings` for the types
    that use it (from the config's top level first, as transformers does for Phi-3).

    `params` overrides the config's own dict (a per-layer-type entry, e.g. Gemma 3's).
    """
    if params is None:
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    out = dict(params or {})
    out["rope_type"] = rope_type_of(out)
    out.pop("type", None)
    if out.get("rope_theta") is None:
        out["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if out.get("partial_rotary_factor") is None:
        out["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    if out["rope_type"] in _ORIGINAL_LENGTH_TYPES:
        top_level = getattr(config, "original_max_position_embeddings", None)
        if top_level is not None:
            out["original_max_position_embeddings"] = top_level
        elif out.get("original_max_position_embeddings") is None:
            out["original_max_position_embeddings"] = config.max_position_embeddings
    return out


def scaled_max_positions(params: dict[str, Any], max_position_embeddings: int) -> int:
    """The longest context the rope scaling serves, as vLLM derives it: linear and dynamic
    stretch `max_position_embeddings` by `factor`, yarn stretches the original length by it;
    llama3 and longrope configs already name their extended length."""
    rope_type = rope_type_of(params)
    factor = params.get("factor")
    if rope_type in ("linear", "dynamic") and factor:
        return int(max_position_embeddings * factor)
    if rope_type == "yarn" and factor:
        original = params.get("original_max_position_embeddings") or max_position_embeddings
        return max(int(original * factor), max_position_embeddings)
    return max_position_embeddings


def max_positions_served(config: Any, params: dict[str, Any] | None = None) -> int:
    """The context length a config's rope serves (`scaled_max_positions` of its rope dict, or
    of `params`), except Gemma 3, whose `max_position_embeddings` is already the scaled
    length (vLLM's exception)."""
    max_position = config.max_position_embeddings
    if "gemma3" in str(getattr(config, "model_type", "")):
        return max_position
    return scaled_max_positions(get_rope_parameters(config, params), max_position)
