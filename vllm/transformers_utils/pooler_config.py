"""`PoolerConfig` (vLLM's) and the model-side defaults it starts from.

A pooling model's default pooling type and normalisation come, as in vLLM, from its
sentence-transformers files when present: `modules.json` names a Pooling module (its
`config.json`'s `pooling_mode_*` flag gives the type) and possibly a Normalize module (then the
embeddings are normalised). Without them vLLM's defaults per kind of model apply. Torch-free.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")

# sentence-transformers' pooling_mode_* flags -> vLLM's pooling type.
_ST_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model pools (vLLM's `PoolerConfig`; `--pooler-config` / the older
    `--override-pooler-config`). Unset fields take the model's defaults."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    # Older names of use_activation.
    softmax: bool | None = None
    activation: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str):
                raise ValueError(f"pooling_type must be a string, got {self.pooling_type!r}.")
            upper = self.pooling_type.upper()
            if upper not in POOLING_TYPES:
                raise ValueError(
                    f"pooling_type {self.pooling_type!r} is not supported; choose one of "
                    f"{list(POOLING_TYPES)}."
                )
            object.__setattr__(self, "pooling_type", upper)
        if self.use_activation is None:
            legacy = self.softmax if self.softmax is not None else self.activation
            object.__setattr__(self, "use_activation", legacy)
        object.__setattr__(self, "softmax", None)
        object.__setattr__(self, "activation", None)

    @classmethod
    def from_any(cls, value: Any) -> PoolerConfig | None:
        """A PoolerConfig from itself, a dict or a JSON string (the CLI's form); unknown keys
        are a ValueError naming them."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"pooler_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise TypeError(
                f"pooler_config must be a PoolerConfig, a dict or JSON, got {type(value).__name__}."
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown fields {unknown}; known: {sorted(known)}.")
        return cls(**value)

    def merged_over(self, defaults: PoolerConfig) -> PoolerConfig:
        """These values where set, else `defaults`'."""
        changes = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(defaults, **{k: v for k, v in changes.items() if v is not None})


def sentence_transformers_pooling(model_dir: str) -> PoolerConfig | None:
    """The pooling type and normalisation a sentence-transformers model declares (None when
    the directory has no `modules.json` with a Pooling module)."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        modules = json.load(f)
    pooling_dir = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            pooling_dir = module.get("path", "")
        elif kind.endswith("Normalize"):
            normalize = True
    if pooling_dir is None:
        return None
    config_path = os.path.join(model_dir, pooling_dir, "config.json")
    pooling_type = None
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            st_config = json.load(f)
        for flag, name in _ST_MODES.items():
            if st_config.get(flag):
                pooling_type = name
                break
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def default_pooler_config(convert: str, encoder_only: bool) -> PoolerConfig:
    """vLLM's defaults without sentence-transformers files: an embedder pools the last token
    (decoders) or [CLS] (encoders) and normalises; a classifier pools the same way and applies
    its activation; a reward model returns every token's output."""
    if convert == "reward":
        return PoolerConfig(pooling_type="ALL", normalize=False)
    pooling_type = "CLS" if encoder_only else "LAST"
    if convert == "classify":
        return PoolerConfig(pooling_type=pooling_type, use_activation=True)
    return PoolerConfig(pooling_type=pooling_type, normalize=True)
