"""Tool-call parsers and the tool_choice / structured-field rules, without a model (torch-free,
milliseconds)."""

from __future__ import annotations

import json

import pytest

from vllm.entrypoints.openai.protocol import ChatCompletionRequest, ParameterError
from vllm.entrypoints.openai.structured_fields import structured_outputs_from_request
from vllm.entrypoints.openai.tool_parsers import ToolParserManager
from vllm.entrypoints.openai.tools import forced_tool_calls, tool_choice_mode, tool_schema

pytestmark = pytest.mark.fast

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _parse(name: str, text: str):
    parser = ToolParserManager.get_tool_parser(name)(None)
    info = parser.extract_tool_calls(text, None)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    return info.tools_called, calls, info.content


@pytest.mark.parametrize(
    "name, text, content",
    [
        (
            "hermes",
            'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            "Sure.",
        ),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {}}',
            None,
        ),
        (
            "mistral",
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {}}]',
            None,
        ),
        ("pythonic", '[get_weather(city="Paris"), get_time()]', None),
    ],
)
def test_parsers_find_every_call(name, text, content):
    called, calls, got_content = _parse(name, text)
    assert called
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert got_content == content


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_plain_text_is_content(name):
    called, calls, content = _parse(name, "The weather is fine.")
    assert not called and calls == [] and content == "The weather is fine."


def test_broken_call_is_content_not_an_error():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert _parse("hermes", text) == (False, [], text)


def test_streaming_holds_back_only_what_may_open_a_call():
    hermes = ToolParserManager.get_tool_parser("hermes")(None)
    assert not hermes.may_start_tool_call("Hello there")
    assert hermes.may_start_tool_call("Hello <tool")
    assert hermes.may_start_tool_call("Hi <tool_call>{")
    llama = ToolParserManager.get_tool_parser("llama3_json")(None)
    assert llama.may_start_tool_call(' {"na') and not llama.may_start_tool_call("Hi {")


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_tool_choice_modes_and_errors():
    assert tool_choice_mode(_request(), False, False) == ("none", None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_mode(_request(tools=[TOOL], tool_choice=named), False, False) == (
        "named",
        "get_weather",
    )
    with pytest.raises(ParameterError, match="has not been passed in `tools`"):
        bad = {"type": "function", "function": {"name": "nope"}}
        tool_choice_mode(_request(tools=[TOOL], tool_choice=bad), False, False)
    with pytest.raises(ParameterError, match="--enable-auto-tool-choice"):
        tool_choice_mode(_request(tools=[TOOL], tool_choice="auto"), False, False)
    assert tool_choice_mode(_request(tools=[TOOL]), True, True) == ("auto", None)
    request = _request(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    schema = tool_schema(request, "required", None)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    calls = forced_tool_calls(
        '[{"name": "get_weather", "parameters": {"city": "Rome"}}]', "required", None
    )
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"})
    ]


def test_response_format_and_extras_to_one_constraint():
    schema = {"type": "object"}
    request = _request(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    params, param = structured_outputs_from_request(request)
    assert params.json == schema and param == "response_format"
    params, _ = structured_outputs_from_request(_request(guided_choice=["a", "b"]))
    assert params.choice == ["a", "b"]
    params, _ = structured_outputs_from_request(
        _request(structured_outputs={"regex": "a+", "disable_any_whitespace": True})
    )
    assert params.regex == "a+" and params.disable_any_whitespace
    assert structured_outputs_from_request(_request(response_format={"type": "text"}))[0] is None
    with pytest.raises(ValueError, match="only use one kind") as info:
        structured_outputs_from_request(
            _request(guided_regex="a", response_format=request.response_format)
        )
    assert info.value.param == "response_format"


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("deepseek_r1", "I think so.</think>\n\nYes.", ("I think so.", "Yes.")),
        ("deepseek_r1", "<think>Hmm</think>No", ("Hmm", "No")),
        ("deepseek_r1", "still thinking", ("still thinking", "")),
        ("qwen3", "<think>a</think>b", ("a", "b")),
        ("qwen3", "no tags", (None, "no tags")),
    ],
)
def test_reasoning_parsers(name, text, expected):
    from vllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

    parser = get_reasoning_parser(name)
    assert parser.split(text, final=True) == expected
    # Streamed: each prefix's split extends the previous one (deltas never take text back).
    last_r, last_c = "", ""
    for end in range(1, len(text) + 1):
        reasoning, content = parser.split(text[:end], final=end == len(text))
        assert (reasoning or "").startswith(last_r) and content.startswith(last_c), text[:end]
        last_r, last_c = reasoning or "", content
    assert (last_r or None, last_c) == (expected[0] or None, expected[1])


@pytest.mark.parametrize(
    "name, text",
    [
        (
            "hermes",
            'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}"}}\n'
            '</tool_call><tool_call>{"arguments": {"a": [1, {"b": 2}]}, "name": "get_time"}'
            "</tool_call>",
        ),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city":"Paris"}}; '
            '{"name": "get_time", "parameters": {}}',
        ),
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "X"}}]'),
    ],
)
def test_streamed_tool_call_pieces_add_up_to_the_whole(name, text):
    """Every prefix of the output gives calls whose arguments extend what earlier prefixes
    gave; the pieces the streamer sends add up to the whole output's calls (raw text)."""
    from vllm.entrypoints.openai.tool_streaming import ToolCallStreamer

    parser = ToolParserManager.get_tool_parser(name)(None)
    whole = parser.extract_tool_calls(text, None)
    streamer = ToolCallStreamer()
    pieces = []
    for end in range(len(text) + 1):
        partial = parser.partial_calls(text[:end])
        if partial is not None:
            pieces += streamer.deltas([(c.name, c.arguments) for c in partial[1]])
    pieces += streamer.finish(whole.tool_calls)
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        entry = calls.setdefault(piece.index, ["", ""])
        entry[0] += piece.function.name or ""
        entry[1] += piece.function.arguments or ""
    assert [tuple(calls[i]) for i in sorted(calls)] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]
    assert len(pieces) > 2 * len(whole.tool_calls)  # more than one piece per call
    assert all(json.loads(c.function.arguments) is not None for c in whole.tool_calls)


def test_required_output_cut_short_keeps_the_calls_so_far():
    text = '[{"name": "get_weather", "parameters": {"city": "Ro'
    calls = forced_tool_calls(text, "required", None)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Ro')
    ]
    named = forced_tool_calls('{"city": "Ro', "named", "get_weather")
    assert [(c.function.name, c.function.arguments) for c in named] == [
        ("get_weather", '{"city": "Ro')
    ]
