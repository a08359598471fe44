"""The Responses API's bodies (`POST /v1/responses`), stateless subset: the request (unknown
fields refused, stateful ones refused by name) turned into chat messages and SamplingParams,
and the response object and stream events in OpenAI's shapes."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm.entrypoints.openai.openai_fields import (
    FieldError,
    check_metadata,
    check_reasoning_effort,
    check_service_tier,
    check_verbosity,
)
from vllm.entrypoints.openai.protocol import (
    JsonSchemaResponseFormat,
    ParameterError,
    ResponseFormat,
    random_uuid,
)
from vllm.entrypoints.openai.structured_fields import (
    StructuredFieldError,
    structured_outputs_from_request,
)
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.structured_output.params import StructuredOutputsParams

# Input item roles; OpenAI's "developer" is the chat template's "system".
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Content part types read as text (input for user/system turns, output for assistant ones).
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseTextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseTextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: ResponseTextFormat = Field(default_factory=ResponseTextFormat)
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses. An unknown field is a 400 (pydantic's `extra_forbidden`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: ResponseTextConfig | None = None
    stream: bool = False
    # Stateful or unsupported parts: accepted only at their "off" values (checked below).
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    conversation: Any | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # Echoed back, no effect on generation.
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    safety_identifier: str | None = None  # an end-user id for abuse monitoring, as `user`
    prompt_cache_key: str | None = None  # a routing hint: one server has nothing to route
    # Honoured with OpenAI's meaning, or a 400 naming them (check_stateless).
    reasoning: dict[str, Any] | None = None  # effort -> the template's reasoning_effort
    truncation: Literal["auto", "disabled"] | None = None  # auto: drop the oldest items
    service_tier: str | None = None  # this server's one tier: "auto" / "default"
    stream_options: dict[str, Any] | None = None  # include_obfuscation
    # vLLM's extras, as on the other routes.
    seed: int | None = None
    top_k: int | None = None
    structured_outputs: dict[str, Any] | None = None

    def check_stateless(self) -> None:
        """400s, naming the field, for what needs server-side state or is not implemented."""
        refused = [
            ("previous_response_id", self.previous_response_id is not None, "stored responses"),
            ("store", self.store is True, "stored responses; send store=false or omit it"),
            ("background", self.background is True, "background responses"),
            ("conversation", self.conversation is not None, "conversations"),
            ("tools", bool(self.tools), "tools on /v1/responses"),
            ("include", bool(self.include), "include"),
            ("top_logprobs", bool(self.top_logprobs), "logprobs on /v1/responses"),
        ]
        for name, bad, what in refused:
            if bad:
                raise ParameterError(
                    f"{name}: this server is stateless and does not support {what}.", name
                )
        if self.stream_options is not None and not self.stream:
            raise ParameterError(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        unknown = set(self.stream_options or {}) - {"include_obfuscation"}
        if unknown:
            raise ParameterError(
                f"stream_options has unknown fields {sorted(unknown)}; allowed: "
                "include_obfuscation.",
                "stream_options",
            )
        obfuscation = (self.stream_options or {}).get("include_obfuscation")
        if obfuscation is not None and not isinstance(obfuscation, bool):
            raise ParameterError(
                "stream_options.include_obfuscation must be a boolean.", "stream_options"
            )
        reasoning = dict(self.reasoning or {})
        unknown = set(reasoning) - {"effort", "summary", "generate_summary"}
        if unknown:
            raise ParameterError(
                f"reasoning has unknown fields {sorted(unknown)}; allowed: effort, summary.",
                "reasoning",
            )
        if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
            raise ParameterError(
                "reasoning.summary is not supported: this server writes no reasoning "
                "summaries (omit it or send null).",
                "reasoning",
            )
        try:
            check_reasoning_effort(reasoning.get("effort"), "reasoning")
            check_service_tier(self.service_tier)
            check_metadata(self.metadata)
            if self.text is not None:
                check_verbosity(self.text.verbosity, "text")
        except FieldError as exc:
            raise ParameterError(str(exc), exc.param) from None

    @property
    def reasoning_effort(self) -> str | None:
        """`reasoning.effort`, given to the chat template as `reasoning_effort` (as vLLM)."""
        return (self.reasoning or {}).get("effort")

    @property
    def include_obfuscation(self) -> bool:
        """OpenAI's stream obfuscation (random padding on delta events), when asked for."""
        return bool((self.stream_options or {}).get("include_obfuscation"))

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages: `instructions` as the system message first,
        then `input` (a string is one user turn)."""
        out: list[dict[str, str]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            return out
        if not self.input:
            raise ParameterError("input must not be empty.", "input")
        for i, item in enumerate(self.input):
            out.append(_message(item, i))
        return out

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """`text.format` (and vLLM's `structured_outputs` extra: its options, such as
        `disable_any_whitespace`, or a constraint of its own) as one StructuredOutputsParams,
        by the chat route's rules; a refusal names `text` or `structured_outputs`."""
        fmt = self.text.format if self.text is not None else None
        response_format = None
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_schema" and fmt.json_schema is None:
                raise ParameterError(
                    "text.format.schema is required when type is 'json_schema'.", "text"
                )
            spec = None
            if fmt.type == "json_schema":
                spec = JsonSchemaResponseFormat(
                    name=fmt.name or "response", schema=fmt.json_schema, strict=fmt.strict
                )
            response_format = ResponseFormat(type=fmt.type, json_schema=spec)
        fields = SimpleNamespace(
            structured_outputs=self.structured_outputs,
            response_format=response_format,
            guided_json=None,
            guided_regex=None,
            guided_choice=None,
            guided_grammar=None,
            guided_whitespace_pattern=None,
        )
        try:
            structured, _ = structured_outputs_from_request(fields)
        except StructuredFieldError as exc:
            param = "text" if exc.param == "response_format" else exc.param
            raise ParameterError(str(exc), param) from None
        return structured

    def to_sampling_params(self) -> SamplingParams:
        structured = self.structured_outputs_params()
        return SamplingParams(
            max_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured,
        )


def _message(item: Any, index: int) -> dict[str, str]:
    """One input item (an easy message or a `type: message` item) as a chat message."""
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise ParameterError(f"{where} must be an object.", "input")
    kind = item.get("type", "message")
    if kind != "message":
        raise ParameterError(f"{where}: input items of type {kind!r} are not supported.", "input")
    unknown = set(item) - {"type", "role", "content", "id", "status"}
    if unknown:
        raise ParameterError(f"{where}: unknown fields {sorted(unknown)}.", "input")
    role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise ParameterError(f"{where}.role must be one of {sorted(_ROLES)}.", "input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise ParameterError(f"{where}.content must be a string or a list of parts.", "input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ParameterError(
                f"{where}.content[{j}]: only text parts are supported, got {kind!r}.", "input"
            )
        texts.append(str(part.get("text", "")))
    return {"role": role, "content": "".join(texts)}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The assistant message output item (no content part yet when `text` is None)."""
    content = [] if text is None else [output_text_part(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def response_object(
    request: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    """OpenAI's `response` object."""
    fmt = request.text.format if request.text is not None else ResponseTextFormat()
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": (
            {"reason": incomplete_reason} if incomplete_reason is not None else None
        ),
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": (
            True if request.parallel_tool_calls is None else request.parallel_tool_calls
        ),
        "previous_response_id": None,
        "reasoning": {"effort": request.reasoning_effort, "summary": None},
        # The tier that served it (OpenAI reports the one used): this server has one.
        "service_tier": "default",
        "prompt_cache_key": request.prompt_cache_key,
        "safety_identifier": request.safety_identifier,
        "store": False,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True),
            "verbosity": "medium",
        },
        "tool_choice": request.tool_choice or "auto",
        "tools": [],
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "truncation": request.truncation or "disabled",
        "usage": usage,
        "user": request.user,
    }


def usage_object(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def new_ids() -> tuple[str, str, int]:
    """(response id, message item id, created_at)."""
    return f"resp_{random_uuid()}", f"msg_{random_uuid()}", int(time.time())
