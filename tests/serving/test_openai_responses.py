"""/v1/responses (stateless) at PP = 1 and 2 through the official `openai` client: text and
message inputs with instructions equal `LLM.chat`, the stream's event types and order, the
response object's shape, text.format json_schema, and the 400s for the stateful parts and
unknown fields."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.utils.server_utils import ServerThread
from vllm import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from vllm.structured_output.params import StructuredOutputsParams

KIND = "llama-gqa-tied"
MODEL = "tiny"
SETTINGS = dict(kv_cache_space=0.05, swap_space=0.01)
QUESTION = "What is the capital of France?"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    llm = LLM(tiny_model_dirs[KIND], **SETTINGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module", params=[1, 2], ids=["pp1", "pp2"])
def server(request, tiny_model_dirs):
    if request.param > 1:
        request.getfixturevalue("ray_session")
    args = AsyncEngineArgs(
        model=tiny_model_dirs[KIND],
        pipeline_parallel_size=request.param,
        served_model_name=MODEL,
        disable_log_requests=True,
        **SETTINGS,
    )
    srv = ServerThread(AsyncLLMEngine.from_engine_args(args))
    yield srv
    srv.stop()


def chat(reference: LLM, messages: list[dict], max_tokens: int, **kw) -> tuple[str, str, int, int]:
    """(text, finish_reason, prompt tokens, output tokens) of LLM.chat, greedy."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    out = reference.chat(messages, params, use_tqdm=False)[0]
    first = out.outputs[0]
    return first.text, first.finish_reason, len(out.prompt_token_ids), len(first.token_ids)


def test_text_input_equals_llm_chat(server, reference):
    text, finish, n_prompt, n_out = chat(reference, [{"role": "user", "content": QUESTION}], 12)
    resp = server.client().responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == text
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert [p.type for p in item.content] == ["output_text"] and item.content[0].text == text
    assert resp.usage.input_tokens == n_prompt
    assert resp.usage.output_tokens == n_out
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if finish == "length":
        assert resp.status == "incomplete"
        assert resp.incomplete_details.reason == "max_output_tokens"
        assert resp.usage.output_tokens == 12
    else:
        assert resp.status == "completed" and resp.incomplete_details is None


def test_messages_with_instructions_and_parts(server, reference):
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": QUESTION},
    ]
    text, _, n_prompt, _ = chat(reference, messages, 10)
    resp = server.client().responses.create(
        model=MODEL,
        instructions="Answer in one word.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello!"}],
            },
            {"role": "user", "content": QUESTION},
        ],
        max_output_tokens=10,
        temperature=0,
    )
    assert resp.output_text == text and resp.usage.input_tokens == n_prompt
    assert resp.instructions == "Answer in one word."
    # "developer" is the system turn.
    again = server.client().responses.create(
        model=MODEL,
        input=[{"role": "developer", "content": "Answer in one word."}, *messages[1:]],
        max_output_tokens=10,
        temperature=0,
    )
    assert again.output_text == text


def test_stream_events(server, reference):
    text, finish, n_prompt, n_out = chat(reference, [{"role": "user", "content": QUESTION}], 16)
    events = list(
        server.client().responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    last = "response.incomplete" if finish == "length" else "response.completed"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert len(deltas) > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == text
    done = events[kinds.index("response.output_text.done")]
    assert done.text == text and done.item_id == events[2].item.id
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == text and final.usage.input_tokens == n_prompt
    assert final.usage.output_tokens == n_out
    assert final.id == events[0].response.id


def test_raw_stream_has_event_lines(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b]
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]


def test_obfuscation_pads_delta_events_when_asked(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "stream": True}
    options = {"stream_options": {"include_obfuscation": True}}
    for extra, padded in (({}, False), (options, True)):
        with httpx.stream(
            "POST", server.url + "/v1/responses", json={**body, **extra}, timeout=60
        ) as r:
            events = [
                json.loads(b.split("\n")[1][6:]) for b in r.read().decode().split("\n\n") if b
            ]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert deltas
        for e in deltas:
            assert ("obfuscation" in e) == padded
            if padded:
                assert (len(e["delta"]) + len(e["obfuscation"])) % 32 == 0


def test_truncation_auto_drops_the_oldest_items(server):
    """OpenAI's truncation="auto": an input longer than the context loses items from its
    start (the instructions stay); "disabled" (the default) is a 400."""
    long = "apple banana cherry " * 60  # ~180 tokens: two of them and more do not fit 512
    items = [
        {"role": "user", "content": long},
        {"role": "assistant", "content": long},
        {"role": "user", "content": long + QUESTION},
    ]
    kw = dict(model=MODEL, instructions="Be brief.", max_output_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError) as info:
        server.client().responses.create(input=items, **kw)
    assert info.value.body["param"] == "input"
    cut = server.client().responses.create(input=items, truncation="auto", **kw)
    kept = server.client().responses.create(input=items[1:], **kw)  # the first item went
    assert cut.output_text == kept.output_text and cut.truncation == "auto"
    assert cut.usage.input_tokens == kept.usage.input_tokens


def test_text_format_json_schema(server, reference):
    # A random model loops on JSON whitespace; vLLM's structured_outputs extra turns it off.
    structured = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    text, finish, _, _ = chat(
        reference, [{"role": "user", "content": QUESTION}], 40, structured_outputs=structured
    )
    assert finish == "stop", text
    resp = server.client().responses.create(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    assert resp.output_text == text and resp.status == "completed"
    assert resp.text.format.type == "json_schema"
    jsonschema.validate(json.loads(text), SCHEMA)
    # Without the extra: the same grammar (the reference's text under the same schema).
    plain, _, _, _ = chat(
        reference,
        [{"role": "user", "content": QUESTION}],
        12,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    again = server.client().responses.create(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=12,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
    )
    assert again.output_text == plain and plain.startswith("{")
    with pytest.raises(openai.BadRequestError) as info:
        server.client().responses.create(
            model=MODEL,
            input=QUESTION,
            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}},
        )
    assert info.value.body["param"] == "text"


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"model": "other"}, "model"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_refused_parts(server, extra, param):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["param"] == param
    if param == "previous_response_id":
        assert "stateless" in r.json()["message"]
    # store=false and omitted are fine.
    ok = server.client().responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert ok.status in ("completed", "incomplete")
