"""Tool-call parsers, one module per model format, registered by the names
`--tool-call-parser` takes: hermes, llama3_json, mistral, pythonic."""

from vllm.entrypoints.openai.tool_parsers import (  # noqa: F401  (registration)
    hermes_tool_parser,
    llama_tool_parser,
    mistral_tool_parser,
    pythonic_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
)

__all__ = ["ExtractedToolCallInformation", "ToolParser", "ToolParserManager"]
