"""Structured outputs in the engine: JSON schemas, regex, choice and grammar constrain a tiny
random model's output (which would otherwise be noise) at PP=1, TP=2 x PP=2 on mp (chunked
prefill, prefix caching, async scheduling) and PP=2 on Ray, with n=2 seeded samples; greedy
outputs identical across depths, and through a stage kill."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.utils import tiny_models
from vllm import LLM, SamplingParams
from vllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams

KIND = "llama-gqa-untied"

SCHEMAS = [
    {  # nested objects
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    {  # arrays of enums
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {  # anyOf
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "boolean"},
                    {"type": "string", "maxLength": 4},
                ]
            }
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    {  # string patterns and bounded numbers
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "score", "ok"],
        "additionalProperties": False,
    },
    {  # an array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "null"}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
    {"enum": ["alpha", "beta", 3, None]},  # a bare enum
]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" num ("+" num)? ("+" num)? ")"\nnum ::= [1-9] [0-9]?'


def _json_params(schema: dict, **kw) -> SamplingParams:
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return SamplingParams(temperature=0, max_tokens=120, structured_outputs=so, **kw)


def _requests() -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        prompts.append(tiny_models.PROMPTS[i % len(tiny_models.PROMPTS)])
        params.append(_json_params(schema))
    prompts += [tiny_models.PROMPTS[7], tiny_models.PROMPTS[1], tiny_models.PROMPTS[2]]
    params += [
        SamplingParams(
            temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=REGEX)
        ),
        # The 0.6-era spelling of the same feature.
        SamplingParams(
            temperature=0, max_tokens=30, guided_decoding=GuidedDecodingParams(choice=CHOICES)
        ),
        SamplingParams(
            temperature=0,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(grammar=GRAMMAR),
        ),
    ]
    # n=2 seeded samples, each with its own matcher; logprobs of the masked distribution.
    prompts.append(tiny_models.PROMPTS[3])
    so = StructuredOutputsParams(json=SCHEMAS[3], disable_any_whitespace=True)
    params.append(
        SamplingParams(
            n=2, temperature=1.0, seed=7, max_tokens=120, logprobs=2, structured_outputs=so
        )
    )
    return prompts, params


def _parse(text: str):
    # xgrammar's JSON strings admit raw control characters (U+000B...), which strict JSON
    # parsers refuse; everything else is standard JSON.
    return json.loads(text, strict=False)


def _check(outputs) -> None:
    """Every output is complete (finish_reason "stop": the grammar ended it) and valid."""
    for out, schema in zip(outputs, SCHEMAS):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (comp.text, comp.finish_reason)
        jsonschema.validate(_parse(comp.text), schema)
    regex_out, choice_out, grammar_out, sampled = outputs[len(SCHEMAS) :]
    assert re.fullmatch(REGEX, regex_out.outputs[0].text), regex_out.outputs[0].text
    assert choice_out.outputs[0].text in CHOICES
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,2}\)", grammar_out.outputs[0].text)
    assert len(sampled.outputs) == 2
    for comp in sampled.outputs:
        assert comp.finish_reason == "stop", comp.text
        jsonschema.validate(_parse(comp.text), SCHEMAS[3])
        for token, entry in zip(comp.token_ids, comp.logprobs):
            assert entry[token].logprob > float("-inf")  # the drawn token was allowed


def _texts(outputs) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    """PP=1 outputs of every request (one in-process engine)."""
    llm = LLM(tiny_model_dirs[KIND], kv_cache_space=0.05, swap_space=0.01)
    prompts, params = _requests()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    yield llm, outputs
    llm.shutdown()


def test_outputs_follow_their_constraint_pp1(reference):
    _check(reference[1])


def test_unconstrained_requests_unchanged_next_to_constrained(reference):
    llm, _ = reference
    plain = SamplingParams(temperature=0, max_tokens=8)
    alone = llm.generate([tiny_models.PROMPTS[0]], plain, use_tqdm=False)
    mixed = llm.generate(
        [tiny_models.PROMPTS[0], tiny_models.PROMPTS[1]],
        [plain, _json_params(SCHEMAS[1])],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_stop_strings_and_pydantic_schemas(reference):
    """A stop string cuts a constrained output as any other; a pydantic model is a schema."""
    import pydantic

    class Point(pydantic.BaseModel):
        x: int = pydantic.Field(ge=0, le=99)
        label: str = pydantic.Field(max_length=5)

    llm, outputs = reference
    full = outputs[len(SCHEMAS)].outputs[0].text  # the regex request: digits, "-", letters
    regex = SamplingParams(
        temperature=0,
        max_tokens=30,
        stop=["-"],
        structured_outputs=StructuredOutputsParams(regex=REGEX),
    )
    point = _json_params(Point)
    cut, obj = llm.generate([tiny_models.PROMPTS[7], "A"], [regex, point], use_tqdm=False)
    assert cut.outputs[0].text == full.split("-")[0] and cut.outputs[0].stop_reason == "-"
    assert obj.outputs[0].finish_reason == "stop"
    Point.model_validate(_parse(obj.outputs[0].text))


def test_bad_constraints_refused_at_add_request(reference):
    llm, _ = reference
    engine = llm.llm_engine
    bad = [
        (StructuredOutputsParams(regex="(abc"), "regex"),
        (StructuredOutputsParams(json={"type": 5}), "json schema"),
        (StructuredOutputsParams(grammar="root ::= missing"), "grammar"),
    ]
    for so, name in bad:
        params = SamplingParams(structured_outputs=so)
        with pytest.raises(ValueError, match=f"Invalid {name} for structured outputs"):
            engine.add_request("bad", "hello", params)
    assert not engine.has_unfinished_requests()


def test_params_validation():
    with pytest.raises(ValueError, match="only use one kind of structured outputs"):
        StructuredOutputsParams(json={}, regex="a")
    assert SamplingParams(structured_outputs=StructuredOutputsParams()).structured_outputs is None
    with pytest.raises(ValueError, match="one kind of guided decoding"):
        GuidedDecodingParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="both structured_outputs and guided_decoding"):
        SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a"),
            guided_decoding=GuidedDecodingParams(regex="a"),
        )
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(
            use_beam_search=True,
            best_of=2,
            temperature=0,
            structured_outputs=StructuredOutputsParams(regex="a"),
        )
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"jsn": {}})
    converted = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert converted.structured_outputs == StructuredOutputsParams(choice=["a", "b"])


def _assert_same(expected, got) -> None:
    """The greedy requests (all but the last): the same token ids and text. The seeded n=2
    request is only checked for validity: with async scheduling a decode can be scheduled
    before the engine sees that a sibling sample ended, and the ended sibling still takes its
    row of the group's seeded random draw, so the survivor's next draw may differ from PP=1's
    (a property of seeded n>1 sampling under async scheduling, not of the mask)."""
    assert _texts(got)[:-1] == _texts(expected)[:-1]
    assert [[c.token_ids for c in o.outputs] for o in got[:-1]] == [
        [c.token_ids for c in o.outputs] for o in expected[:-1]
    ]


def test_tp2_pp2_mp_chunked_prefill_prefix_caching_same_outputs(reference, tiny_model_dirs):
    """TP=2 x PP=2 on mp with async scheduling (only the last stage's TP driver holds matchers
    and samples), chunked prefill (a 16-token budget splits the long prompts) and prefix
    caching (the second run hits the cache): the same greedy tokens as PP=1."""
    llm = LLM(
        tiny_model_dirs[KIND],
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=16,
        enable_prefix_caching=True,
        kv_cache_space=0.05,
        swap_space=0.01,
    )
    try:
        prompts, params = _requests()
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    _check(first)
    _assert_same(reference[1], first)
    _assert_same(reference[1], again)


@pytest.mark.ray
def test_pp2_ray_same_outputs_and_survives_a_stage_kill(reference, ray_session, tiny_model_dirs):
    """PP=2 on Ray: the same outputs as PP=1; then the last stage (which holds the matchers)
    is killed mid-generation, replaced, and rebuilds the matchers from the committed tokens:
    outputs still valid and equal to the fault-free run."""
    from tests.utils.faults import after_steps, kill_stage

    llm = LLM(
        tiny_model_dirs[KIND],
        pipeline_parallel_size=2,
        kv_cache_space=0.05,
        swap_space=0.01,
        disable_log_stats=True,
    )
    try:
        prompts, params = _requests()
        clean = llm.generate(prompts, params, use_tqdm=False)
        _assert_same(reference[1], clean)
        victim: list[int] = []
        thread = after_steps(llm, 6, lambda: victim.append(kill_stage(llm, 1, "SIGKILL")))
        survived = llm.generate(prompts, params, use_tqdm=False)
        thread.join()
        assert victim, "the stage was never killed"
        assert llm.llm_engine.fault_events, "no failure was seen"
    finally:
        llm.shutdown()
    _check(survived)
    _assert_same(clean, survived)


# A Lark grammar (vLLM accepts `grammar` in Lark form as well as EBNF), finite so that a
# random model's output always ends.
LARK = r"""
start: "(" pair (";" pair)~0..2 ")"
pair: KEY "=" value
?value: "yes"i | NUM | "[" NUM ("," NUM)? "]"
KEY: /[a-z][a-z0-9_]{0,3}/
NUM: /-?[0-9]{1,3}/
"""


def test_lark_grammar_rewrite_accepts_what_lark_accepts():
    """The rewritten EBNF accepts exactly the strings Lark itself accepts."""
    import lark
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from vllm.structured_output.lark_to_ebnf import convert_lark_to_ebnf

    parser = lark.Lark(LARK)
    ebnf = xgr.Grammar.from_ebnf(convert_lark_to_ebnf(LARK))
    cases = ["(a=yes)", "(a=YeS;b1=-12;c=[1,2])", "(k=[7])", "(a=1;b=2;c=3;d=4)", "(A=1)",
             "(a=1234)", "(a=[1,2,3])", "(a_bcd=1)", "(ab=1", "(a=-0)"]  # fmt: skip
    for text in cases:
        try:
            parser.parse(text)
            ok = True
        except lark.exceptions.LarkError:
            ok = False
        assert _is_grammar_accept_string(ebnf, text) == ok, text


def test_lark_grammar_constrains_output(reference):
    """A Lark grammar through SamplingParams: every output (greedy, and n=3 seeded) parses
    under the grammar with Lark; a grammar in neither form is refused at add_request."""
    import lark

    llm, _ = reference
    so = StructuredOutputsParams(grammar=LARK)
    outputs = llm.generate(
        [tiny_models.PROMPTS[0], tiny_models.PROMPTS[5]],
        [
            SamplingParams(temperature=0, max_tokens=60, structured_outputs=so),
            SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=60, structured_outputs=so),
        ],
        use_tqdm=False,
    )
    parser = lark.Lark(LARK)
    texts = [c.text for o in outputs for c in o.outputs]
    assert len(texts) == 4
    for out in outputs:
        for comp in out.outputs:
            assert comp.finish_reason == "stop", comp.text
            parser.parse(comp.text)
    with pytest.raises(ValueError, match="failed to convert the grammar from Lark to EBNF"):
        bad = StructuredOutputsParams(grammar="neither ebnf nor lark")
        llm.llm_engine.add_request("bad", "hi", SamplingParams(structured_outputs=bad))
    assert not llm.llm_engine.has_unfinished_requests()
