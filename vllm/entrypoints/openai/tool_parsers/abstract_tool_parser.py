"""The tool-call parser interface (vLLM's `ToolParser`) and its registry
(`ToolParserManager`, the names `--tool-call-parser` takes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.protocol import FunctionCall, ToolCall
from vllm.entrypoints.openai.tool_parsers.json_calls import PartialCall, scan_calls


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
    `extract_tool_calls`; a parser is one function of the text. `start_markers`: strings that
    open a tool call in this format (the stream holds text back from the first one).

    A JSON format also implements `call_segments`: then a stream sends each call's name and
    its arguments as they are generated (`partial_calls`), and the whole output's calls carry
    the same raw arguments text (`with_raw_arguments`), so the pieces add up to it."""

    start_markers: tuple[str, ...] = ()
    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def call_segments(self, text: str) -> tuple[int, list[str]] | None:
        """Where the calls begin in `text` (the content is what comes before) and the JSON
        text holding them, segment by segment; None before a call begins, or for a format
        that is not JSON."""
        return None

    def partial_calls(self, text: str) -> tuple[int, list[PartialCall]] | None:
        """(where the calls begin, the calls so far) of a growing output; None as above."""
        found = self.call_segments(text)
        if found is None:
            return None
        begin, segments = found
        calls = [call for segment in segments for call in scan_calls(segment, self.argument_keys)]
        return begin, calls

    def with_raw_arguments(
        self, text: str, info: ExtractedToolCallInformation
    ) -> ExtractedToolCallInformation:
        """`info`'s calls with the arguments as the model wrote them (what a stream sent)."""
        found = self.partial_calls(text) if info.tools_called else None
        if found is None or len(found[1]) != len(info.tool_calls):
            return info
        for call, partial in zip(info.tool_calls, found[1]):
            if partial.done and partial.name == call.function.name:
                call.function.arguments = partial.arguments
        return info

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
