"""Hermes (NousResearch, Qwen2.5) tool calls: `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, one block per call, with optional content before the first."""

from __future__ import annotations

import json
import re
from typing import Any

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    make_tool_call,
)

# A block closed by </tool_call>, or the last one left open when generation stopped.
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@ToolParserManager.register_module("hermes")
class HermesToolParser(ToolParser):
    start_markers = ("<tool_call>",)

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if "<tool_call>" not in model_output:
            return ExtractedToolCallInformation(False, [], model_output)
        try:
            calls = []
            for closed, open_ in _BLOCK.findall(model_output):
                body = json.loads((closed or open_).strip())
                calls.append(make_tool_call(body.get("name"), body.get("arguments")))
        except (ValueError, AttributeError):
            return ExtractedToolCallInformation(False, [], model_output)
        content = model_output[: model_output.find("<tool_call>")]
        info = ExtractedToolCallInformation(True, calls, content if content.strip() else None)
        return self.with_raw_arguments(model_output, info)

    def call_segments(self, text: str) -> tuple[int, list[str]] | None:
        begin = text.find("<tool_call>")
        if begin < 0:
            return None
        return begin, [closed or open_ for closed, open_ in _BLOCK.findall(text)]
