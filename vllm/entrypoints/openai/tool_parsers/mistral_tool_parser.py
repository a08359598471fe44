"""Mistral tool calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`."""

from __future__ import annotations

import json
from typing import Any

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    make_tool_call,
)

BOT = "[TOOL_CALLS]"


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    start_markers = (BOT,)

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if BOT not in model_output:
            return ExtractedToolCallInformation(False, [], model_output)
        content, _, body = model_output.partition(BOT)
        try:
            value = json.loads(body.strip())
            items = value if isinstance(value, list) else [value]
            calls = [make_tool_call(item.get("name"), item.get("arguments")) for item in items]
        except (ValueError, AttributeError):
            return ExtractedToolCallInformation(False, [], model_output)
        info = ExtractedToolCallInformation(True, calls, content if content.strip() else None)
        return self.with_raw_arguments(model_output, info)

    def call_segments(self, text: str) -> tuple[int, list[str]] | None:
        begin = text.find(BOT)
        if begin < 0:
            return None
        return begin, [text[begin + len(BOT) :]]
