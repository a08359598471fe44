"""Pythonic tool calls (Llama 3.2/4): a Python list of calls, `[get_weather(city="Paris"),
f(x=1)]`, read with `ast` (literal arguments only)."""

from __future__ import annotations

import ast
from typing import Any

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    make_tool_call,
)


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{_call_name(func.value)}.{func.attr}"
    raise ValueError("a tool call must name a function")


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    start_markers = ("[",)

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        text = model_output.strip()
        if not (text.startswith("[") and text.endswith("]")):
            return ExtractedToolCallInformation(False, [], model_output)
        try:
            tree = ast.parse(text, mode="eval").body
            if not isinstance(tree, ast.List):
                raise ValueError("not a list")
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or node.args:
                    raise ValueError("only keyword arguments are allowed")
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                calls.append(make_tool_call(_call_name(node.func), args))
        except (SyntaxError, ValueError):
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(bool(calls), calls, None)

    def may_start_tool_call(self, text: str) -> bool:
        stripped = text.lstrip()
        return not stripped or stripped[0] == "["
