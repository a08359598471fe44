"""The tool-call parser interface (vLLM's `ToolParser`) and its registry
(`ToolParserManager`, the names `--tool-call-parser` takes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.protocol import FunctionCall, ToolCall


@dataclass
class ExtractedToolCallInformation:
    """What a parser found in a whole model output."""

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


def make_tool_call(name: Any, arguments: Any) -> ToolCall:
    """A ToolCall with `arguments` as JSON text (a dict is serialised; text kept as is)."""
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a function name")
    if arguments is None:
        arguments = {}
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(function=FunctionCall(name=name, arguments=text))


class ToolParser:
    """Finds tool calls in a model's output text. Subclasses implement
    `extract_tool_calls`; streaming reuses it on the whole text (serving_chat.py), so a
    parser is one function of the text. `start_markers`: strings that open a tool call in
    this format (the stream holds text back from the first one)."""

    start_markers: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def may_start_tool_call(self, text: str) -> bool:
        """True when `text` (the output so far) contains or ends with the start of a marker,
        so it must not be streamed as plain content yet."""
        stripped = text.lstrip()
        for marker in self.start_markers:
            if marker in text:
                return True
            if stripped and marker.startswith(stripped[: len(marker)]):
                return True
            for k in range(1, len(marker)):
                if text.endswith(marker[:k]):
                    return True
        return False


class ToolParserManager:
    """Registry of tool parsers by name (vLLM's decorator API)."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            cls.tool_parsers[name] = parser
            return parser

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise KeyError(f"tool call parser: '{name}' not found in tool_parsers")
        return cls.tool_parsers[name]
