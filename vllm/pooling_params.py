"""`PoolingParams`: what a pooling request (embed, classify, score, encode) asks of the pooler.

vLLM's field names and validation messages (vLLM 0.10.2 / 0.11): `dimensions` and `normalize`
for embeddings, `use_activation` (older aliases `activation` and `softmax`) for
classification and scoring, `step_tag_id` / `returned_token_ids` for STEP pooling. `verify`
fills what the request left unset from the model's pooler config and refuses what its task
does not take. Imports no torch: the engine's bookkeeping reads it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal, get_args

# The pooling tasks ("encode": every token's pooled output, vLLM 0.10's name for what 0.11
# splits into "token_embed" and "token_classify"; reward models run it).
PoolingTask = Literal["encode", "embed", "classify", "score", "token_embed", "token_classify"]
POOLING_TASKS: tuple[str, ...] = get_args(PoolingTask)

_VALID_PARAMETERS: dict[str, list[str]] = {
    "embed": ["dimensions", "normalize"],
    "classify": ["use_activation"],
    "score": ["use_activation"],
    "encode": ["dimensions", "normalize", "use_activation"],
    "token_embed": ["dimensions", "normalize"],
    "token_classify": ["use_activation"],
}
_ALL_PARAMETERS = ("dimensions", "normalize", "use_activation")


@dataclass
class PoolingParams:
    """API parameters for pooling models (vLLM's).

    truncate_prompt_tokens: keep only the last k prompt tokens (-1: the model's maximum;
        None: no truncation).
    dimensions: reduce the embedding's dimensions (Matryoshka models only).
    normalize: L2-normalize the embedding (default True for embeddings).
    use_activation: apply the classifier's activation (sigmoid for one label, else softmax);
        `activation` and `softmax` are its older names.
    step_tag_id / returned_token_ids: STEP pooling (process reward models).
    task: set by the entrypoint (`LLM.embed` -> "embed", ...); a user may preset it.
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None
    use_activation: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    task: str | None = None
    # Internal: the request must not read the prefix cache (MEAN/ALL/STEP pool every token).
    skip_reading_prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (not isinstance(tpt, int) or isinstance(tpt, bool) or tpt < -1):
            raise ValueError(
                f"truncate_prompt_tokens must be an integer >= -1 or None, got {tpt!r}."
            )
        dims = self.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)):
            raise TypeError(f"dimensions must be an integer or None, got {dims!r}.")
        for name in ("normalize", "softmax", "activation", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool or None, got {value!r}.")
        if self.step_tag_id is not None and not isinstance(self.step_tag_id, int):
            raise TypeError(f"step_tag_id must be an integer or None, got {self.step_tag_id!r}.")
        if self.returned_token_ids is not None:
            ids = self.returned_token_ids
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise TypeError(f"returned_token_ids must be a list of integers, got {ids!r}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task: {self.task}")

    @property
    def all_parameters(self) -> list[str]:
        return list(_ALL_PARAMETERS)

    @property
    def valid_parameters(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in _VALID_PARAMETERS.items()}

    def clone(self) -> PoolingParams:
        """A deep copy (the engine keeps its own)."""
        return copy.deepcopy(self)

    def verify(self, task: str, model_config: Any = None) -> None:
        """Set the task (a preset different one is an error, as vLLM), fold the deprecated
        `softmax` / `activation` into `use_activation`, take unset values from the model's
        pooler config, apply the task's defaults and refuse parameters the task does not take.
        """
        if task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task: {task}")
        if self.task is None:
            self.task = task
        elif self.task != task:
            raise ValueError(f"You cannot overwrite self.task={self.task!r} with task={task!r}!")
        self.use_activation = _use_activation(self)
        self.softmax = self.activation = None
        pooler_config = getattr(model_config, "pooler_config", None)
        if pooler_config is not None:
            self._merge_defaults(pooler_config)
        self._set_defaults(model_config)
        self._verify_valid()

    def _merge_defaults(self, pooler_config: Any) -> None:
        assert self.task is not None
        for name in _VALID_PARAMETERS[self.task]:
            default = getattr(pooler_config, name, None)
            if default is not None and getattr(self, name) is None:
                setattr(self, name, default)
        step_names = ("step_tag_id", "returned_token_ids")
        if getattr(pooler_config, "pooling_type", None) != "STEP":
            invalid = [name for name in step_names if getattr(self, name) is not None]
            if invalid:
                raise ValueError(
                    f"Task {self.task} only supports {_VALID_PARAMETERS[self.task]} "
                    f"parameters, does not support {invalid} parameters"
                )
        else:
            for name in step_names:
                default = getattr(pooler_config, name, None)
                if default is not None and getattr(self, name) is None:
                    setattr(self, name, default)

    def _set_defaults(self, model_config: Any) -> None:
        if self.task in ("embed", "token_embed", "encode"):
            if self.normalize is None and self.task != "encode":
                self.normalize = True
            if self.dimensions is not None and model_config is not None:
                name = getattr(model_config, "served_model_name", None) or getattr(
                    model_config, "model", ""
                )
                if not getattr(model_config, "is_matryoshka", False):
                    raise ValueError(
                        f'Model "{name}" does not support matryoshka representation, '
                        "changing output dimensions will lead to poor results."
                    )
                dims = getattr(model_config, "matryoshka_dimensions", None)
                if dims is not None:
                    if self.dimensions not in dims:
                        raise ValueError(
                            f'Model "{name}" only supports {dims} matryoshka dimensions, '
                            "use other output dimensions will lead to poor results."
                        )
                elif self.dimensions < 1:
                    raise ValueError("Dimensions must be greater than 0")
        if self.task in ("classify", "score", "token_classify") and self.use_activation is None:
            self.use_activation = True

    def _verify_valid(self) -> None:
        assert self.task is not None
        valid = _VALID_PARAMETERS[self.task]
        invalid = [k for k in _ALL_PARAMETERS if k not in valid and getattr(self, k) is not None]
        if invalid:
            raise ValueError(
                f"Task {self.task} only supports {valid} parameters, does not support "
                f"{invalid} parameters"
            )

    def __repr__(self) -> str:
        return (
            f"PoolingParams(task={self.task}, normalize={self.normalize}, "
            f"dimensions={self.dimensions}, use_activation={self.use_activation}, "
            f"step_tag_id={self.step_tag_id}, returned_token_ids={self.returned_token_ids}, "
            f"truncate_prompt_tokens={self.truncate_prompt_tokens})"
        )


def _use_activation(params: PoolingParams) -> bool | None:
    """`use_activation`, or the deprecated `softmax` / `activation` when only they are set."""
    legacy = [v for v in (params.softmax, params.activation) if v is not None]
    if params.use_activation is not None:
        if any(v != params.use_activation for v in legacy):
            raise ValueError(
                "use_activation conflicts with the deprecated softmax/activation; "
                "set use_activation only."
            )
        return params.use_activation
    if len(set(legacy)) > 1:
        raise ValueError("softmax and activation disagree; set use_activation only.")
    return legacy[0] if legacy else None
