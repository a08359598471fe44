"""Structured outputs and tool calling through the OpenAI server, with the official client, at
-pp 1 and -pp 2: response_format json_schema, guided_regex / guided_choice / guided_json, clear
400s, tool_choice required / named / auto with the hermes and llama3_json parsers (streamed
deltas reassembled equal the whole response), and a tool result fed back through the chat
template."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.utils.server_utils import ServerThread
from tests.utils.tool_cases import HERMES_TEMPLATE, NO_WS, SCHEMAS, TOOLS, USER
from vllm import AsyncEngineArgs, AsyncLLMEngine

KIND = "llama-gqa-untied"
MODEL = "tiny"
CITY = "[A-Z][a-z]{1,6}"
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "' + CITY + r'", "unit": '
    r'"(c|f)"\}\}\n</tool_call>'
)
LLAMA_CALL = (
    r'\{"name": "get_weather", "parameters": \{"city": "' + CITY + r'", "unit": "(c|f)"\}\}'
)


@pytest.fixture(scope="module", params=[1, 2], ids=["pp1", "pp2"])
def servers(request, tiny_model_dirs):
    """One engine, two apps on it: the hermes parser and the llama3_json parser."""
    pp = request.param
    args = AsyncEngineArgs(
        model=tiny_model_dirs[KIND],
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp" if pp > 1 else None,
        served_model_name=MODEL,
        disable_log_requests=True,
        kv_cache_space=0.05,
        swap_space=0.01,
    )
    engine = AsyncLLMEngine.from_engine_args(args)
    kw = dict(chat_template=HERMES_TEMPLATE, enable_auto_tool_choice=True)
    hermes = ServerThread(engine, tool_call_parser="hermes", **kw)
    llama = ServerThread(engine, tool_call_parser="llama3_json", **kw)
    think = ServerThread(engine, reasoning_parser="deepseek_r1")
    yield {"hermes": hermes, "llama3_json": llama, "deepseek_r1": think}
    think.stop(shutdown_engine=False)
    llama.stop(shutdown_engine=False)
    hermes.stop()


@pytest.fixture
def client(servers):
    return servers["hermes"].client()


def _parse(text: str):
    return json.loads(text, strict=False)  # xgrammar strings may hold raw control chars


def _obj(properties: dict, required: list[str]) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
# Twenty schemas a random model must still finish within max_tokens (every string, array and
# number bounded): nested objects, arrays, enums, anyOf, $ref, const and string patterns.
TWENTY_SCHEMAS = [
    {"type": "integer", "minimum": 0, "maximum": 999},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, "two", True, None]},
    {"const": "ok"},
    {"type": "string", "maxLength": 5},
    {"type": "string", "pattern": "^[A-Z][a-z]{1,4}$"},
    {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
    {"type": "array", "items": _DIGIT, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    _obj({"a": {"type": "boolean"}}, ["a"]),
    _obj(
        {
            "k": {"type": "string", "maxLength": 3},
            "v": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        ["k"],
    ),  # noqa: E501
    _obj({"p": _obj({"x": _DIGIT, "y": _DIGIT}, ["x", "y"])}, ["p"]),
    _obj(
        {"level": {"enum": ["low", "high"]}, "code": {"type": "string", "pattern": "^[0-9]{3}$"}},
        ["level", "code"],
    ),  # noqa: E501
    {"type": "array", "items": _obj({"id": _DIGIT}, ["id"]), "maxItems": 2},
    {"anyOf": [_DIGIT, {"enum": ["none"]}]},
    {"anyOf": [_obj({"cat": {"type": "boolean"}}, ["cat"]), _obj({"dog": _DIGIT}, ["dog"])]},
    {
        "$defs": {"pt": _obj({"x": _DIGIT}, ["x"])},
        **_obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, ["a", "b"]),
    },
]


def test_twenty_json_schemas_parse_and_validate(client):
    """response_format json_schema (strict) with the official client: every output of twenty
    schemas parses and validates, at PP 1 and 2."""
    assert len(TWENTY_SCHEMAS) == 20
    for i, schema in enumerate(TWENTY_SCHEMAS):
        response = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            temperature=0,
            max_tokens=120,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
            extra_body=NO_WS,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(_parse(choice.message.content), schema)


def test_response_format_json_schema(client):
    schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
                "pos": {
                    "type": "object",
                    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["x"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "tags", "pos"],
            "additionalProperties": False,
        },
        {"anyOf": [{"type": "boolean"}, {"type": "string", "pattern": "^[a-c]{2}$"}]},
    ]
    for schema in schemas:
        response = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            temperature=0,
            max_tokens=80,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
            extra_body=NO_WS,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(_parse(choice.message.content), schema)
    response = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        temperature=0,
        max_tokens=80,
        response_format={"type": "json_object"},
        extra_body=NO_WS,
    )
    # Any JSON value; a random model may keep a string open until max_tokens.
    choice = response.choices[0]
    assert choice.message.content[:1] in ("{", "[", '"', "t", "f", "n", "-") or (
        choice.message.content[:1].isdigit()
    )
    if choice.finish_reason == "stop":
        _parse(choice.message.content)


def test_guided_regex_choice_json_on_completions(client):
    regex = r"\d{2}-[a-z]{3}"
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=20, temperature=0,
        extra_body={"guided_regex": regex},
    )  # fmt: skip
    assert re.fullmatch(regex, out.choices[0].text), out.choices[0].text
    choices = ["red", "green", "blue"]
    out = client.completions.create(
        model=MODEL, prompt="A", max_tokens=20, temperature=0.8, n=3, seed=3,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert all(c.text in choices for c in out.choices)
    schema = SCHEMAS["get_weather"]
    out = client.completions.create(
        model=MODEL, prompt="B", max_tokens=60, temperature=0,
        extra_body={"guided_json": schema, **NO_WS},
    )  # fmt: skip
    jsonschema.validate(_parse(out.choices[0].text), schema)


def test_guided_grammar_in_lark_form(client):
    """vLLM's `guided_grammar` takes Lark as well as EBNF: the output parses under the
    grammar with Lark itself."""
    import lark

    grammar = 'start: WORD (" " WORD)~0..2 "."\nWORD: /[a-z]{1,5}/'
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=30, temperature=0.7, seed=1, n=2,
        extra_body={"guided_grammar": grammar},
    )  # fmt: skip
    parser = lark.Lark(grammar)
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        parser.parse(choice.text)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"guided_json": {"type": 7}}, "guided_json"),
        ({"guided_grammar": "neither ebnf nor lark"}, "guided_grammar"),
        ({"guided_grammar": "start: missing"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },  # noqa: E501
            "response_format",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),  # noqa: E501
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, extra_body=body)
    assert info.value.body["param"] == param, info.value.body


def test_unknown_field_is_logged_not_fatal(client, caplog):
    response = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, extra_body={"no_such_field": 1}
    )
    assert response.choices[0].message.content is not None
    assert "present in the request but ignored" in caplog.text and "no_such_field" in caplog.text


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed(
    client, reasoning: list | None = None, pieces: list | None = None, **kw
) -> tuple[str, list, str]:
    """(content, tool calls, finish_reason) reassembled from a stream's deltas (reasoning
    deltas appended to `reasoning`, tool-call deltas to `pieces`)."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            if reasoning is not None:
                reasoning.append(getattr(delta, "reasoning_content", None) or "")
            for tc in delta.tool_calls or []:
                if pieces is not None:
                    pieces.append(tc)
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_choice_arguments_parse_streamed_or_not(client, choice):
    named = {"type": "function", "function": {"name": "get_time"}}
    tool_choice = "required" if choice == "required" else named
    # parallel_tool_calls=False bounds the list to one call (a random model never closes it).
    kw = dict(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, temperature=0,
        max_tokens=120, extra_body=NO_WS, parallel_tool_calls=False,
    )  # fmt: skip
    response = client.chat.completions.create(**kw)
    message = response.choices[0].message
    calls = _calls(message)
    assert calls and message.content is None, (message, response.choices[0].finish_reason)
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if choice == "named":
        assert [name for name, _ in calls] == ["get_time"]
        assert response.choices[0].finish_reason == "stop"
    else:
        assert response.choices[0].finish_reason == "tool_calls"
    pieces: list = []
    content, streamed, finish = _streamed(client, pieces=pieces, **kw)
    assert streamed == calls and not content
    assert finish == response.choices[0].finish_reason
    # The arguments stream as they are generated: id and name first, then pieces.
    assert len(pieces) > 2 and pieces[0].id and pieces[0].function.name == calls[0][0]
    assert all(p.id is None and p.function.name is None for p in pieces[1:])


def test_named_tool_call_cut_by_max_tokens_is_still_a_tool_call(client):
    """vLLM and OpenAI: arguments cut by max_tokens come back truncated in the tool call,
    finish_reason "length", never as plain content."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=named, temperature=0,
        max_tokens=3, extra_body=NO_WS,
    )  # fmt: skip
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    [(name, arguments)] = _calls(choice.message)
    assert name == "get_weather" and arguments.startswith("{") and arguments != "{}"
    content, streamed, finish = _streamed(client, **kw)
    assert (content, streamed, finish) == ("", [(name, arguments)], "length")


@pytest.mark.parametrize("parser, regex", [("hermes", HERMES_CALL), ("llama3_json", LLAMA_CALL)])
def test_auto_tool_call_round_trip(servers, parser, regex):
    """The model (steered into the parser's format by a regex) calls a tool; the parser turns
    it into tool_calls, streamed and whole alike; the call and its result go back through the
    chat template and the conversation goes on."""
    srv = servers[parser]
    client = srv.client()
    kw = dict(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="auto", temperature=0,
        max_tokens=60, extra_body={"guided_regex": regex},
    )  # fmt: skip
    response = client.chat.completions.create(**kw)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    [(name, arguments)] = _calls(message)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert message.tool_calls[0].id and message.tool_calls[0].type == "function"
    pieces: list = []
    content, streamed, finish = _streamed(client, pieces=pieces, **kw)
    assert streamed == [(name, arguments)] and finish == "tool_calls"
    assert (content or None) == message.content
    # Incremental: the id and name first, then the arguments as they are generated.
    assert pieces[0].id and pieces[0].function.name == name and len(pieces) > 3
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    call_id = message.tool_calls[0].id
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": call_id, "content": "21 degrees"},
    ]
    follow_up = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0
    )
    assert follow_up.choices[0].message.tool_calls == []
    import httpx

    rendered = httpx.post(
        srv.url + "/tokenize", json={"model": MODEL, "messages": history}, timeout=30
    ).json()
    tokenizer = srv.engine.engine.get_tokenizer()
    text = tokenizer.decode(rendered["tokens"])
    assert "<tool_response>\n21 degrees\n</tool_response>" in text
    assert json.loads(arguments)["city"] in text


def test_auto_without_a_tool_call_is_plain_content(client):
    kw = dict(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=20,
        extra_body={"guided_regex": "Sunny, [0-9]{2} degrees"},
    )  # fmt: skip
    response = client.chat.completions.create(**kw)
    message = response.choices[0].message
    assert message.tool_calls == [] and re.fullmatch("Sunny, [0-9]{2} degrees", message.content)
    content, streamed, _ = _streamed(client, **kw)
    assert content == message.content and streamed == []


def test_reasoning_parser_splits_think_tags(servers):
    client = servers["deepseek_r1"].client()
    kw = dict(
        model=MODEL, messages=USER, temperature=0, max_tokens=20,
        extra_body={"guided_regex": "[a-z]{3,6}</think>\n\n(yes|no)"},
    )  # fmt: skip
    message = client.chat.completions.create(**kw).choices[0].message
    assert re.fullmatch("[a-z]{3,6}", message.reasoning_content) and message.content in (
        "yes",
        "no",
    )
    pieces: list = []
    content, _, _ = _streamed(client, reasoning=pieces, **kw)
    assert "".join(pieces) == message.reasoning_content and content == message.content
