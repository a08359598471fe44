"""Tool calling on /v1/chat/completions: checking `tools` / `tool_choice`, the JSON schema a
`required` or named choice imposes through structured outputs (so the arguments always parse),
and the tool calls read back from such an output. `auto` goes through the `--tool-call-parser`
(tool_parsers/)."""

from __future__ import annotations

import json
from typing import Any

from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    ParameterError,
    ToolCall,
)
from vllm.entrypoints.openai.tool_parsers.json_calls import PartialCall, scan_calls


def _functions(request: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """name -> function definition of the request's tools (ParameterError when malformed)."""
    functions: dict[str, dict[str, Any]] = {}
    for tool in request.tools or []:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ParameterError(
                "each tool must be {'type': 'function', 'function': ...}.", "tools"
            )
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ParameterError("each tool's function needs a 'name'.", "tools")
        functions[function["name"]] = function
    return functions


def tool_choice_mode(
    request: ChatCompletionRequest, enable_auto_tools: bool, has_parser: bool
) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function) after vLLM's checks."""
    functions = _functions(request)
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ParameterError(
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}.",
                "tool_choice",
            )
        if name not in functions:
            raise ParameterError(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
        return "named", name
    if choice not in ("none", "auto", "required"):
        raise ParameterError(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}.",
            "tool_choice",
        )
    if choice == "required" and not functions:
        raise ParameterError("tool_choice 'required' needs at least one tool.", "tool_choice")
    if choice == "auto" and functions and not (enable_auto_tools and has_parser):
        raise ParameterError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
            "set",
            "tool_choice",
        )
    if not functions:
        return "none", None
    return choice, None


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def tool_schema(request: ChatCompletionRequest, mode: str, name: str | None) -> dict | None:
    """The JSON schema of the output for `required` (a list of {name, parameters}) and named
    (the function's parameters) choices, as vLLM builds it; None otherwise."""
    functions = _functions(request)
    if mode == "named":
        assert name is not None
        return _parameters(functions[name])
    if mode != "required":
        return None
    items = {
        "type": "object",
        "anyOf": [
            {
                "properties": {
                    "name": {"type": "string", "enum": [fname]},
                    "parameters": _parameters(function),
                },
                "required": ["name", "parameters"],
            }
            for fname, function in functions.items()
        ],
    }
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def forced_tool_calls(text: str, mode: str, name: str | None) -> list[ToolCall]:
    """The tool calls of an output constrained by `tool_schema`: a named choice's one call, a
    required list's calls (arguments truncated when max_tokens cut them)."""
    if mode == "named":
        assert name is not None
        # The output is the arguments: kept as generated (as vLLM), so a stream of it
        # reassembles to the same text.
        return [ToolCall(function=FunctionCall(name=name, arguments=text))]
    # The list's calls with their arguments as generated (what a stream sends piece by
    # piece); cut by max_tokens, the calls named so far, the last one's arguments truncated.
    return [
        ToolCall(
            function=FunctionCall(
                name=call.name, arguments=call.arguments if call.has_arguments else "{}"
            )
        )
        for call in required_calls(text)
        if call.name is not None
    ]


def required_calls(text: str) -> list[PartialCall]:
    """The calls of a `required` choice's output (`[{"name", "parameters"}, ...]`), so far."""
    return scan_calls(text, ("parameters",))


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant's tool-call arguments as dicts
    (OpenAI sends JSON text), tool results and tool-call ids kept."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                call = dict(call)
                function = dict(call.get("function") or {})
                args = function.get("arguments")
                if isinstance(args, str):
                    try:
                        function["arguments"] = json.loads(args)
                    except ValueError:
                        raise ParameterError(
                            "tool_calls arguments must be JSON text.", "messages"
                        ) from None
                call["function"] = function
                fixed.append(call)
            message["tool_calls"] = fixed
        out.append(message)
    return out
