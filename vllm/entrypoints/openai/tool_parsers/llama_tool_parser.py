"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` (or `arguments`), optionally
after `<|python_tag|>`, several separated by `;`."""

from __future__ import annotations

import json
from typing import Any

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    make_tool_call,
)


def decode_json_objects(text: str) -> list[Any]:
    """The JSON values of `text`, one after another, separated by whitespace, `;` or `,`
    (ValueError when anything else is left)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(text):
            return values
        value, pos = decoder.raw_decode(text, pos)
        values.append(value)


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    start_markers = ("<|python_tag|>", "{")

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        text = model_output.strip()
        if text.startswith("<|python_tag|>"):
            text = text[len("<|python_tag|>") :]
        if not text.startswith("{"):
            return ExtractedToolCallInformation(False, [], model_output)
        try:
            calls = []
            for obj in decode_json_objects(text):
                args = obj.get("parameters", obj.get("arguments"))
                calls.append(make_tool_call(obj.get("name"), args))
        except (ValueError, AttributeError):
            return ExtractedToolCallInformation(False, [], model_output)
        return self.with_raw_arguments(
            model_output, ExtractedToolCallInformation(bool(calls), calls, None)
        )

    def call_segments(self, text: str) -> tuple[int, list[str]] | None:
        begin = len(text) - len(text.lstrip())
        body = text[begin:]
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :]
        if not body.lstrip().startswith("{"):
            return None
        return begin, [body]

    def may_start_tool_call(self, text: str) -> bool:
        # Only an output that *starts* with the JSON (or the tag) is a tool call.
        stripped = text.lstrip()
        return not stripped or stripped[0] == "{" or "<|python_tag|>".startswith(stripped[:14])
