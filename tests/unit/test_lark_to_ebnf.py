"""Lark grammars rewritten as xgrammar's EBNF: which form a grammar is in (vLLM's test), the
rewrite of each Lark construct, and a ValueError naming the line for what has no EBNF form
(torch-free, milliseconds; tests/models/test_structured_output.py checks the rewritten
grammars accept exactly what Lark accepts, and drives them through the engine)."""

from __future__ import annotations

import json

import pytest

from vllm.sampling_params import StructuredOutputsParams
from vllm.structured_output import grammar_spec
from vllm.structured_output.lark_to_ebnf import convert_lark_to_ebnf, grammar_is_likely_lark

pytestmark = pytest.mark.fast


def test_detection_follows_vllm():
    assert grammar_is_likely_lark("rule: 'abc'")
    assert not grammar_is_likely_lark("rule ::= 'abc'")
    # A `::=` in a comment does not make a grammar EBNF.
    assert grammar_is_likely_lark("// root ::= x\nstart: 'a'")
    assert not grammar_is_likely_lark('root ::= "a" # start: b')


def test_rules_alternatives_and_start():
    grammar = """
    ?value: pair | "(" value ")"   // the first rule, but `start` wins
    start: value
    pair: KEY "=" 'v'
        | KEY
    KEY.2: /[a-z]{1,3}/
    """
    assert convert_lark_to_ebnf(grammar).splitlines() == [
        "root ::= start",
        'value ::= pair | "(" value ")"',
        "start ::= value",
        'pair ::= KEY "=" "v" | KEY',
        "KEY ::= ([a-z] {1,3})",
    ]
    # Without `start`, the first rule is the start; "root" stays free for it.
    assert convert_lark_to_ebnf("root: 'x'") == 'root ::= root_\nroot_ ::= "x"'


def test_constructs():
    cases = {
        "s: 'ab'i": "[aA] [bB]",
        's: "a".."f"': "[a-f]",
        's: ["x"] "y"': '( "x" )? "y"',
        's: "x" ~ 3': '"x" {3}',
        's: "x"~2..4': '"x" {2,4}',
        's: "a" -> alias | "b"': '"a" | "b"',
        r"s: /\d+\.?(?:e|E)./": r'([0-9] + "." ? ( "e" | "E" ) [^\n])',
        # Python quoting and escapes in, JSON's out.
        r"s: 'it\'s \"q\"'": json.dumps('it\'s "q"'),
    }
    for lark, body in cases.items():
        assert convert_lark_to_ebnf(lark).splitlines()[1] == f"s ::= {body}", lark


def test_common_imports():
    ebnf = convert_lark_to_ebnf(
        "start: NUMBER WS? N\n%import common.NUMBER\n"
        "%import common (WS)\n%import common.INT -> N\n%ignore WS"
    )
    names = [line.split(" ::= ")[0] for line in ebnf.splitlines()]
    assert names == ["root", "start", "NUMBER", "WS", "N"]


@pytest.mark.parametrize(
    "grammar, message",
    [
        ("", "cannot be empty"),
        ("start: foo | BAR", "Referenced rules are not defined: BAR, foo"),
        ("hello world", "line 1: expected a rule definition"),
        ("start: 'a'\n  'b'", "line 2: expected a rule definition 'name: ...' or an alternative"),
        ("start: 'a", "line 1: unexpected character"),
        ("start: /a(?=b)/", "only (?:...) groups"),
        ("start: /^a/", "anchors"),
        ("start: /a+?/", "lazy quantifiers"),
        ("start: 'a'\n%declare X", "line 2: unsupported directive"),
        ("start: ''", "empty string literal"),
        ("start: 'a' ~ x", "'~' takes a count"),
    ],
)
def test_errors_name_the_problem(grammar, message):
    with pytest.raises(
        ValueError,
        match=message.replace("(", r"\(")
        .replace(")", r"\)")
        .replace("?", r"\?")
        .replace(".", r"\."),
    ):
        convert_lark_to_ebnf(grammar)


def test_spec_holds_the_ebnf_and_refuses_neither_form():
    spec = grammar_spec(StructuredOutputsParams(grammar="start: 'a' | 'b'"))
    assert spec.text == 'root ::= start\nstart ::= "a" | "b"'
    ebnf = 'root ::= "a"'
    assert grammar_spec(StructuredOutputsParams(grammar=ebnf)).text == ebnf
    with pytest.raises(
        ValueError,
        match="Invalid grammar for structured outputs: failed to "
        "convert the grammar from Lark to EBNF",
    ):
        grammar_spec(StructuredOutputsParams(grammar="just some words"))
