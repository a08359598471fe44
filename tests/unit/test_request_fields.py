"""Request fields that must never be dropped without a word (torch-free, milliseconds): each
is honoured with OpenAI's / vLLM's meaning or refused with a 400 naming it."""

from __future__ import annotations

import pytest

from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.entrypoints.openai.protocol_responses import ResponsesRequest
from vllm.entrypoints.openai.serving_chat import echoed_content, reply_role
from vllm.entrypoints.openai.serving_engine import error_param
from vllm.structured_output.params import StructuredOutputsParams, grammar_spec

pytestmark = pytest.mark.fast

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
    "$defs": {"c": {"properties": {"d": {"const": {"x": 1}}}}},
}


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def _param_of(request, *args) -> str | None:
    with pytest.raises(ValueError) as info:
        request.to_sampling_params(*args)
    return error_param(info.value)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_whitespace_pattern": r"[ ]?"}, "guided_whitespace_pattern"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_decoding_backend": "xgrammar:no-such-option"}, "guided_decoding_backend"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"verbosity": "low"}, "verbosity"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"store": True}, "store"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"priority": 5}, "priority"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"cache_salt": "s"}, "cache_salt"),
    ],
)
def test_chat_fields_refused_by_name(fields, param):
    assert _param_of(_chat(**fields)) == param


def test_chat_fields_honoured():
    params = _chat(
        guided_json={"type": "object"},
        guided_decoding_backend="xgrammar:no-fallback,disable-any-whitespace,"
        "no-additional-properties",
        service_tier="auto",
        verbosity="medium",
        store=False,
        metadata={"k": "v"},
        prompt_cache_key="conversation-1",
        safety_identifier="user-1",
        reasoning_effort="low",
    ).to_sampling_params()
    so = params.structured_outputs
    assert so.disable_fallback and so.disable_any_whitespace and so.disable_additional_properties
    assert _chat(guided_decoding_backend="auto").to_sampling_params().structured_outputs is None


def test_disable_additional_properties_closes_every_object_schema():
    spec = grammar_spec(StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True))
    import json

    closed = json.loads(spec.text)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["c"]["additionalProperties"] is False
    assert closed["$defs"]["c"]["properties"]["d"] == {"const": {"x": 1}}  # values untouched
    assert "additionalProperties" not in json.loads(grammar_spec(StructuredOutputsParams(
        json=SCHEMA)).text)  # fmt: skip
    explicit = {"type": "object", "additionalProperties": True}
    spec = grammar_spec(StructuredOutputsParams(json=explicit, disable_additional_properties=True))
    assert json.loads(spec.text)["additionalProperties"] is True


def test_completion_guided_whitespace_pattern_is_refused():
    request = CompletionRequest(prompt="x", guided_regex="a+", guided_whitespace_pattern="")
    assert _param_of(request) == "guided_whitespace_pattern"


def test_chat_echo_follows_vllm():
    """The last message is echoed when the reply continues it (same role)."""
    messages = [
        {"role": "user", "content": "Name a city."},
        {"role": "assistant", "content": "The city is"},
    ]
    cont = ChatCompletionRequest(messages=messages, echo=True, add_generation_prompt=False)
    assert reply_role(cont, "assistant") == "assistant"
    assert echoed_content(cont, "assistant") == "The city is"
    fresh = ChatCompletionRequest(messages=messages[:1], echo=True)
    assert echoed_content(fresh, reply_role(fresh, "assistant")) == ""
    off = ChatCompletionRequest(messages=messages, add_generation_prompt=False)
    assert echoed_content(off, "assistant") == ""


def _responses_param(**fields) -> str | None:
    with pytest.raises(ValueError) as info:
        ResponsesRequest(input="hi", **fields).check_stateless()
    return error_param(info.value)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"reasoning": {"effort": "huge"}}, "reasoning"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"reasoning": {"budget": 3}}, "reasoning"),
        ({"text": {"verbosity": "high"}}, "text"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
    ],
)
def test_responses_fields_refused_by_name(fields, param):
    assert _responses_param(**fields) == param


def test_responses_fields_honoured():
    request = ResponsesRequest(
        input="hi",
        stream=True,
        reasoning={"effort": "high", "summary": None},
        text={"verbosity": "medium"},
        service_tier="default",
        prompt_cache_key="k",
        truncation="auto",
        stream_options={"include_obfuscation": True},
    )
    request.check_stateless()
    assert request.reasoning_effort == "high" and request.include_obfuscation


def test_continue_final_message_reaches_the_template():
    """vLLM's continue_final_message: the last (assistant) message is left open."""
    from vllm.entrypoints.openai.serving_chat import chat_prompt

    class Tokenizer:
        def apply_chat_template(self, messages, **kw):
            return repr((messages[-1]["content"], kw["continue_final_message"]))

    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        add_generation_prompt=False,
        continue_final_message=True,
        priority=0,
    )
    request.to_sampling_params()
    assert chat_prompt(Tokenizer(), request) == repr(("Hel", True))
