"""`SpeculativeConfig`: vLLM's `speculative_config` dict (and vLLM 0.5's keyword forms) checked
and frozen. Imports no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# vLLM's keys of `speculative_config` this engine reads. Every other key is refused by name:
# a setting silently ignored would change what the user measures.
_KEYS = {
    "method",
    "model",
    "quantization",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "draft_tensor_parallel_size",
    "disable_by_batch_size",
}
# vLLM 0.5's `LLM(...)` / EngineArgs keywords -> the key of the dict that replaced them.
LEGACY_KEYWORDS = {
    "speculative_model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
    "speculative_draft_tensor_parallel_size": "draft_tensor_parallel_size",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: `method` ("ngram": prompt lookup, no second model;
    "draft_model": `model`, sharing the target's tokenizer, with its own `quantization`), at
    most `num_speculative_tokens` guesses per sequence and step; n-gram sizes tried from
    `prompt_lookup_max` down to `prompt_lookup_min`; speculation pauses while more than
    `disable_by_batch_size` requests run (None: never)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = None
    model: str | None = None
    quantization: str | None = None

    @staticmethod
    def from_user(value: Any) -> SpeculativeConfig | None:
        """Build it from what the user passed (a dict, a JSON string from the command line,
        a SpeculativeConfig or None), with vLLM's checks and messages."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise TypeError(
                f"speculative_config must be a dict (or its JSON text), got {type(value).__name__}."
            )
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; the keys read are {sorted(_KEYS)}."
            )
        method, model = value.get("method"), value.get("model")
        if model == "[ngram]":  # vLLM 0.5's spelling of prompt lookup
            method, model = method or "ngram", None
        if method is None and model is not None:
            method = "draft_model"
        if method is None:
            raise ValueError(
                "speculative_config: set 'method' ('ngram') or 'model' (a draft model)."
            )
        if method in ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp"):
            raise ValueError(
                f"speculative_config: method {method!r} is not supported by this engine yet; "
                "use 'ngram' (prompt lookup) or a draft model ('model')."
            )
        if method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative_config: unknown method {method!r}; this engine supports 'ngram' "
                "and 'draft_model'."
            )
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config: 'model' cannot be set with method 'ngram'.")
        if method == "draft_model" and not model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model'.")
        quantization = value.get("quantization")
        if quantization is not None and method == "ngram":
            raise ValueError("speculative_config: 'quantization' applies to a draft model.")
        k = _int(value, "num_speculative_tokens", None)
        if k is None:
            raise ValueError("speculative_config: num_speculative_tokens must be provided.")
        if k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be > 0, got {k}.")
        lookup_max = _int(value, "prompt_lookup_max", None)
        lookup_min = _int(value, "prompt_lookup_min", None)
        # vLLM's defaults: one of the two given sets the other; neither: 5 and 5.
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = 5
        elif lookup_max is None:
            lookup_max = lookup_min
        elif lookup_min is None:
            lookup_min = lookup_max
        assert lookup_max is not None and lookup_min is not None
        if lookup_min < 1:
            raise ValueError(f"prompt_lookup_min={lookup_min} must be > 0")
        if lookup_max < 1:
            raise ValueError(f"prompt_lookup_max={lookup_max} must be > 0")
        if lookup_min > lookup_max:
            raise ValueError(
                f"prompt_lookup_min={lookup_min} must be <= prompt_lookup_max={lookup_max}"
            )
        tp = _int(value, "draft_tensor_parallel_size", None)
        if tp not in (None, 1):
            raise ValueError(
                f"speculative_config: draft_tensor_parallel_size={tp}: the draft model runs "
                "as one rank of its own here; only 1 is supported."
            )
        disable = _int(value, "disable_by_batch_size", None)
        if disable is not None and disable < 2:
            raise ValueError(
                "Expect the batch size threshold of disabling speculative decoding is > 1, "
                f"but got disable_by_batch_size={disable}"
            )
        return SpeculativeConfig(method, k, lookup_max, lookup_min, disable, model, quantization)

    @staticmethod
    def from_legacy(kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """vLLM 0.5's keywords (`speculative_model="[ngram]"`, `num_speculative_tokens`,
        `ngram_prompt_lookup_max/min`, `speculative_disable_by_batch_size`) as the dict that
        replaced them; None when none was given."""
        given = {key: kwargs[key] for key in LEGACY_KEYWORDS if kwargs.get(key) is not None}
        if not given:
            return None
        return {LEGACY_KEYWORDS[key]: value for key, value in given.items()}


def _int(value: dict[str, Any], key: str, default: int | None) -> int | None:
    found = value.get(key, default)
    if found is None:
        return None
    if isinstance(found, bool) or not isinstance(found, int):
        raise TypeError(f"speculative_config: {key} must be an int, got {found!r}.")
    return found
