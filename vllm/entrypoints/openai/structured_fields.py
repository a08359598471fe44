"""The request fields that constrain the output, to one `StructuredOutputsParams`: OpenAI's
`response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` object and its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` extras, and the schema
a `required` or named `tool_choice` imposes (tools.py). More than one constraint is a 400 with
vLLM's message; so is a known OpenAI field this server does not implement."""

from __future__ import annotations

import json
from typing import Any

from vllm.structured_output.params import StructuredOutputsParams

# OpenAI fields this server knows but does not implement: a 400 naming them, never a silent
# drop (the client would believe it got what it asked for).
UNSUPPORTED_FIELDS = (
    "functions",
    "function_call",
    "audio",
    "prediction",
    "web_search_options",
    # vLLM extras this server does not implement (each would change the output or its
    # guarantees if dropped).
    "bad_words",
    "logits_processors",
    "documents",
    "mm_processor_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
)


# vLLM's `guided_decoding_backend="backend:option,option"` spelling: option -> the
# StructuredOutputsParams field it sets.
BACKEND_OPTIONS = {
    "no-fallback": "disable_fallback",
    "disable-any-whitespace": "disable_any_whitespace",
    "no-additional-properties": "disable_additional_properties",
}
BACKENDS = ("auto", "xgrammar")


class StructuredFieldError(ValueError):
    """A constraint field the server refuses; `param` names it (the 400's `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_unsupported(extra: dict[str, Any]) -> None:
    """Refuse a known-but-unsupported field the request set (`extra`: its unknown fields)."""
    for name in UNSUPPORTED_FIELDS:
        if extra.get(name) is not None:
            raise StructuredFieldError(f"{name} is not supported by this server.", name)
    if extra.get("priority") not in (None, 0):  # vLLM's default priority is the only one
        raise StructuredFieldError(
            "priority is not supported: this server schedules first come, first served "
            "(send 0 or omit it).",
            "priority",
        )
    modalities = extra.get("modalities")
    if modalities is not None and list(modalities) != ["text"]:
        raise StructuredFieldError("only the 'text' modality is supported.", "modalities")


def backend_options(value: str | None) -> dict[str, bool]:
    """The options of a `guided_decoding_backend` value (`xgrammar:no-fallback,...`), as
    StructuredOutputsParams fields; a 400 names the field for another backend or option."""
    if value is None:
        return {}
    name, _, spec = value.partition(":")
    if name not in BACKENDS:
        raise StructuredFieldError(
            f"guided_decoding_backend {name!r} is not available; this server uses 'xgrammar' "
            f"({', '.join(repr(b) for b in BACKENDS)} allowed).",
            "guided_decoding_backend",
        )
    options: dict[str, bool] = {}
    for option in filter(None, (o.strip() for o in spec.split(","))):
        if option not in BACKEND_OPTIONS:
            raise StructuredFieldError(
                f"guided_decoding_backend option {option!r} is not supported; allowed: "
                f"{', '.join(sorted(BACKEND_OPTIONS))}.",
                "guided_decoding_backend",
            )
        options[BACKEND_OPTIONS[option]] = True
    return options


def _response_format_constraint(response_format: Any) -> dict[str, Any]:
    """{field: value} of StructuredOutputsParams that `response_format` asks for."""
    kind = response_format.type
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.json_schema
        if spec is None:
            raise StructuredFieldError(
                "response_format.json_schema is required when type is 'json_schema'.",
                "response_format",
            )
        if spec.json_schema is None:  # a name and no schema: any JSON object
            return {"json_object": True}
        return {"json": spec.json_schema}
    raise StructuredFieldError(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
        "'json_schema'.",
        "response_format",
    )


def structured_outputs_from_request(
    request: Any, tool_schema: dict[str, Any] | None = None
) -> tuple[StructuredOutputsParams | None, str]:
    """The request's one constraint (or None), and the field that set it (for a 400 when the
    grammar engine refuses it)."""
    given: dict[str, Any] = {}
    options: dict[str, Any] = {}
    sources: list[str] = []
    if request.structured_outputs is not None:
        raw = dict(request.structured_outputs)
        for key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if key in raw:
                options[key] = raw.pop(key)
        try:
            StructuredOutputsParams.from_dict({**raw})  # field names and the one-kind rule
        except ValueError as exc:
            raise StructuredFieldError(str(exc), "structured_outputs") from None
        given.update({k: v for k, v in raw.items() if v is not None})
        if given:
            sources.append("structured_outputs")
    guided = {
        "json": request.guided_json,
        "regex": request.guided_regex,
        "choice": request.guided_choice,
        "grammar": request.guided_grammar,
    }
    for key, value in guided.items():
        if value is not None:
            if key == "json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise StructuredFieldError(
                        f"guided_json is not valid JSON: {exc}", "guided_json"
                    ) from None
            given[key] = value
            sources.append(f"guided_{key}")
    if request.guided_whitespace_pattern is not None:
        raise StructuredFieldError(
            "guided_whitespace_pattern is not supported by the xgrammar backend (vLLM's "
            "outlines option); send structured_outputs.disable_any_whitespace=true for JSON "
            "without whitespace.",
            "guided_whitespace_pattern",
        )
    options.update(backend_options(getattr(request, "guided_decoding_backend", None)))
    if request.response_format is not None:
        constraint = _response_format_constraint(request.response_format)
        if constraint:
            given.update(constraint)
            sources.append("response_format")
    if tool_schema is not None:
        given["json"] = tool_schema
        sources.append("tool_choice")
    if len(sources) > 1:
        raise StructuredFieldError(
            "You can only use one kind of structured outputs constraint but multiple are "
            f"specified: {', '.join(sources)}",
            sources[-1],
        )
    param = sources[0] if sources else "structured_outputs"
    if not given:
        return None, param
    try:
        return StructuredOutputsParams(**given, **options), param
    except (TypeError, ValueError) as exc:
        raise StructuredFieldError(str(exc), param) from None
