"""OpenAI request fields that change no token of the output here, checked one way for chat and
/v1/responses: each is either honoured with OpenAI's meaning (the one value this server
implements, a hint it has nothing to act on) or refused with a 400 naming it and the values
allowed. Never a silent drop: a client must not believe it got a tier or a verbosity it did
not get."""

from __future__ import annotations

from typing import Any

# OpenAI's service tiers: this server has one, which is what "auto" and "default" resolve to.
SERVICE_TIERS = ("auto", "default")
# OpenAI's verbosity levels: "medium" is the default, i.e. the model's own behaviour; lower or
# higher would need a model trained for them.
VERBOSITY = ("medium",)
# OpenAI's reasoning efforts; passed to the chat template as `reasoning_effort` (vLLM's way:
# a template that knows it, e.g. gpt-oss's, reads it; others ignore it).
REASONING_EFFORTS = ("minimal", "low", "medium", "high")


class FieldError(ValueError):
    """A field this server refuses; `param` names it (the 400's `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _one_of(value: Any, allowed: tuple[str, ...], param: str, what: str) -> None:
    if value is not None and value not in allowed:
        shown = ", ".join(repr(v) for v in allowed)
        raise FieldError(
            f"{param}={value!r} is not supported: this server has {what} ({shown} allowed).",
            param,
        )


def check_service_tier(value: Any, param: str = "service_tier") -> None:
    _one_of(value, SERVICE_TIERS, param, "one service tier")


def check_verbosity(value: Any, param: str = "verbosity") -> None:
    _one_of(value, VERBOSITY, param, "the model's default verbosity only")


def check_reasoning_effort(value: Any, param: str = "reasoning_effort") -> None:
    _one_of(value, REASONING_EFFORTS, param, "OpenAI's reasoning efforts")


def check_store(value: Any, param: str = "store") -> None:
    if value is True:
        raise FieldError(
            f"{param}=true is not supported: this server is stateless and stores no "
            "completion (send false or omit it).",
            param,
        )


def check_metadata(value: Any, param: str = "metadata") -> None:
    """OpenAI's limits: up to 16 string pairs, keys <= 64 and values <= 512 characters."""
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > 16:
        raise FieldError(f"{param} must be an object of at most 16 key-value pairs.", param)
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > 64:
            raise FieldError(f"{param} keys must be strings of at most 64 characters.", param)
        if not isinstance(item, str) or len(item) > 512:
            raise FieldError(f"{param} values must be strings of at most 512 characters.", param)
