"""Lark grammars for xgrammar: detect a grammar written in Lark form and rewrite it as the
EBNF (GBNF) xgrammar compiles, as vLLM accepts `grammar` in either form.

A grammar is taken as Lark unless one of its lines (comments aside) defines a rule with `::=`
(vLLM's test). The rewrite covers what a decoding grammar uses: rules and terminals (`name:`,
`?name:`, `!name:`, `NAME.2:`), alternatives over several lines, '...' / "..." literals (with
the `i` flag), "a".."z" ranges, /regex/ terminals, `[optional]`, `item ~ n` / `item ~ n..m`,
`-> alias` (dropped: it only shapes Lark's tree) and `%import common.X`. The start rule is
`start` when defined, else the first rule. `%ignore` has no EBNF equivalent: it is dropped with
a warning (vLLM drops it too). Anything else is a ValueError saying what and where.

Pure Python, no grammar engine: called where the request's spec is built.
"""

from __future__ import annotations

import ast
import json
import re
from typing import NamedTuple

from vllm.logger import init_logger

logger = init_logger(__name__)

_COMMENT = re.compile(r"(#|//).*$")

# Lark's common.lark terminals, as self-contained EBNF expressions.
_INT = "[0-9]+"
_EXP = f"[eE] [+-]? {_INT}"
_DECIMAL = f'({_INT} "." [0-9]* | "." {_INT})'
_FLOAT = f"({_INT} {_EXP} | {_DECIMAL} ({_EXP})?)"
_NUMBER = f"({_FLOAT} | {_INT})"
_LETTER = "[a-zA-Z]"
_COMMON = {
    "DIGIT": "[0-9]",
    "HEXDIGIT": "[a-fA-F0-9]",
    "INT": _INT,
    "SIGNED_INT": f"[+-]? {_INT}",
    "DECIMAL": _DECIMAL,
    "FLOAT": _FLOAT,
    "SIGNED_FLOAT": f"[+-]? {_FLOAT}",
    "NUMBER": _NUMBER,
    "SIGNED_NUMBER": f"[+-]? {_NUMBER}",
    "ESCAPED_STRING": r'"\"" ([^"\\\n] | "\\" [^\n])* "\""',
    "LCASE_LETTER": "[a-z]",
    "UCASE_LETTER": "[A-Z]",
    "LETTER": _LETTER,
    "WORD": f"{_LETTER}+",
    "CNAME": "[_a-zA-Z] [_a-zA-Z0-9]*",
    "WS_INLINE": "[ \\t]+",
    "WS": "[ \\t\\f\\r\\n]+",
    "CR": '"\\r"',
    "LF": '"\\n"',
    "NEWLINE": '("\\r"? "\\n")+',
}


def grammar_is_likely_lark(grammar: str) -> bool:
    """True unless a line (after `#` / `//` comments are cut) holds an EBNF `::=` (vLLM's
    rule: "rule ::= 'abc'" is EBNF, "rule: 'abc'" is Lark)."""
    for line in grammar.split("\n"):
        if "::=" in _COMMENT.sub("", line):
            return False
    return True


class _Token(NamedTuple):
    kind: str  # a group name of _TOKEN_RE
    text: str
    line: int


# Order matters: a definition head before a bare name, strings and regexes before comments
# (a '#' inside a literal is not a comment).
_TOKEN_RE = re.compile(
    r"""
    (?P<STRING>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?)
  | (?P<REGEX>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<COMMENT>(?:\#|//)[^\n]*)
  | (?P<NEWLINE>\n)
  | (?P<DIRECTIVE>%[^\n]*)
  | (?P<ARROW>->)
  | (?P<RANGE>\.\.)
  | (?P<NAME>[?!]?[_a-zA-Z][_a-zA-Z0-9]*(?:\.-?[0-9]+)?)
  | (?P<NUMBER>[0-9]+)
  | (?P<OP>[:|()\[\]*+?~])
  | (?P<SPACE>[ \t\r\f]+)
    """,
    re.VERBOSE,
)


def _tokenize(grammar: str) -> list[_Token]:
    tokens: list[_Token] = []
    line, pos = 1, 0
    while pos < len(grammar):
        m = _TOKEN_RE.match(grammar, pos)
        if m is None:
            raise ValueError(f"line {line}: unexpected character {grammar[pos]!r}")
        kind, text = m.lastgroup or "", m.group()
        if kind not in ("SPACE", "COMMENT"):
            tokens.append(_Token(kind, text, line))
        line += text.count("\n")
        pos = m.end()
    return tokens


def _literal(token: _Token) -> str:
    """A Lark string literal as an EBNF literal (JSON escapes), or a sequence of character
    classes for a case-insensitive one."""
    text, insensitive = token.text, token.text.endswith("i")
    if insensitive:
        text = text[:-1]
    try:
        # Lark's literals take Python's quoting and escapes.
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"line {token.line}: invalid string literal {token.text}") from None
    if not value:
        raise ValueError(f"line {token.line}: empty string literal {token.text}")
    if insensitive:
        return " ".join(
            f"[{c.lower()}{c.upper()}]" if c.lower() != c.upper() else json.dumps(c) for c in value
        )
    return json.dumps(value, ensure_ascii=False)


_REGEX_CLASSES = {
    "d": "[0-9]",
    "D": "[^0-9]",
    "w": "[a-zA-Z0-9_]",
    "W": "[^a-zA-Z0-9_]",
    "s": "[ \\t\\n\\r\\f\\v]",
    "S": "[^ \\t\\n\\r\\f\\v]",
}
_REGEX_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}


def _regex(token: _Token) -> str:
    """A Lark /regex/ terminal as an EBNF expression: classes, groups, alternation and
    quantifiers carry over; each other character becomes a literal. Lookarounds,
    backreferences and anchors have no EBNF form and are refused."""
    end = token.text.rindex("/")
    pattern, flags = token.text[1:end], token.text[end + 1 :]
    if flags.strip("x"):
        raise ValueError(f"line {token.line}: regex flags {flags!r} are not supported")
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "[":  # a character class: the same syntax in EBNF
            j = i + 1
            if j < len(pattern) and pattern[j] == "^":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            if j >= len(pattern):
                raise ValueError(f"line {token.line}: unterminated class in {token.text}")
            out.append(pattern[i : j + 1])
            i = j + 1
        elif c == "\\":
            if i + 1 >= len(pattern):
                raise ValueError(f"line {token.line}: dangling escape in {token.text}")
            e = pattern[i + 1]
            if e in _REGEX_CLASSES:
                out.append(_REGEX_CLASSES[e])
            elif e.isdigit() or e in "bBAZ":
                raise ValueError(f"line {token.line}: \\{e} in {token.text} is not supported")
            else:
                out.append(json.dumps(_REGEX_ESCAPES.get(e, e)))
            i += 2
        elif c == "(":
            if pattern.startswith("(?:", i):
                i += 3
            elif pattern.startswith("(?", i):
                raise ValueError(f"line {token.line}: {token.text}: only (?:...) groups")
            else:
                i += 1
            out.append("(")
        elif c == "{":  # {m}, {m,}, {m,n}
            j = pattern.find("}", i)
            if j < 0 or not re.fullmatch(r"[0-9]+(,[0-9]*)?", pattern[i + 1 : j]):
                raise ValueError(f"line {token.line}: bad repetition in {token.text}")
            out.append(pattern[i : j + 1])
            i = j + 1
        elif c in ")|*+?":
            if c == "?" and out and out[-1] in ("*", "+", "?"):
                raise ValueError(f"line {token.line}: lazy quantifiers in {token.text}")
            out.append(c)
            i += 1
        elif c == ".":
            out.append("[^\\n]")
            i += 1
        elif c in "^$":
            raise ValueError(f"line {token.line}: anchors in {token.text} are not supported")
        else:
            out.append(json.dumps(c, ensure_ascii=False))
            i += 1
    return "(" + " ".join(out) + ")"


def _ebnf_name(name: str) -> str:
    # EBNF rule names are case-sensitive identifiers; "root" is the start rule we emit.
    return "root_" if name == "root" else name


class _Rule(NamedTuple):
    name: str
    body: list[_Token]
    line: int


def _split_rules(tokens: list[_Token]) -> tuple[list[_Rule], list[_Token]]:
    """Definitions (`name:` at the start of a line, to the next one) and directives."""
    rules: list[_Rule] = []
    directives: list[_Token] = []
    at_line_start = True
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.kind == "NEWLINE":
            at_line_start = True
            i += 1
            continue
        if at_line_start and tok.kind == "DIRECTIVE":
            directives.append(tok)
        elif (
            at_line_start
            and tok.kind == "NAME"
            and i + 1 < len(tokens)
            and tokens[i + 1].text == ":"
        ):
            name = tok.text.lstrip("?!").split(".")[0]
            rules.append(_Rule(name, [], tok.line))
            i += 2
            at_line_start = False
            continue
        elif not rules:
            raise ValueError(
                f"line {tok.line}: expected a rule definition 'name: ...', got {tok.text!r}"
            )
        else:
            if at_line_start and tok.text != "|" and rules[-1].body:
                # A new line continues a rule only with an alternative.
                raise ValueError(
                    f"line {tok.line}: expected a rule definition 'name: ...' or an "
                    f"alternative '| ...', got {tok.text!r}"
                )
            rules[-1].body.append(tok)
        at_line_start = False
        i += 1
    return rules, directives


def _body(rule: _Rule, refs: set[str]) -> str:
    out: list[str] = []
    toks = rule.body
    i = 0
    while i < len(toks):
        tok = toks[i]
        if tok.kind == "STRING":
            if i + 2 < len(toks) and toks[i + 1].kind == "RANGE" and toks[i + 2].kind == "STRING":
                lo, hi = json.loads(_literal(tok)), json.loads(_literal(toks[i + 2]))
                if len(lo) != 1 or len(hi) != 1:
                    raise ValueError(f"line {tok.line}: a range takes single characters")
                out.append(f"[{_class_char(lo)}-{_class_char(hi)}]")
                i += 3
                continue
            out.append(_literal(tok))
        elif tok.kind == "REGEX":
            out.append(_regex(tok))
        elif tok.kind == "NAME":
            if tok.text[0] in "?!" or "." in tok.text:
                raise ValueError(f"line {tok.line}: unexpected {tok.text!r} in rule {rule.name}")
            refs.add(tok.text)
            out.append(_ebnf_name(tok.text))
        elif tok.kind == "ARROW":
            i += 2  # `-> alias` names a tree node in Lark; nothing to match
            continue
        elif tok.text == "[":
            out.append("(")
        elif tok.text == "]":
            out.append(")?")
        elif tok.text == "~":
            nums = toks[i + 1 : i + 4]
            if nums and nums[0].kind == "NUMBER":
                if len(nums) == 3 and nums[1].kind == "RANGE" and nums[2].kind == "NUMBER":
                    out.append(f"{{{nums[0].text},{nums[2].text}}}")
                    i += 4
                else:
                    out.append(f"{{{nums[0].text}}}")
                    i += 2
                continue
            raise ValueError(f"line {tok.line}: '~' takes a count in rule {rule.name}")
        elif tok.kind == "OP" and tok.text in "|()*+?":
            out.append(tok.text)
        else:
            raise ValueError(f"line {tok.line}: unexpected {tok.text!r} in rule {rule.name}")
        i += 1
    if not out:
        raise ValueError(f"line {rule.line}: rule {rule.name} is empty")
    return " ".join(out)


def _class_char(c: str) -> str:
    if c in "]\\^-":
        return "\\" + c
    return json.dumps(c)[1:-1]


def _directive(tok: _Token, common: dict[str, str]) -> None:
    text = tok.text.strip()
    if text.startswith("%ignore"):
        logger.warning("Lark grammar line %d: %r has no EBNF equivalent; ignored", tok.line, text)
        return
    m = re.fullmatch(r"%import\s+common\.([A-Z_]+)(?:\s*->\s*(\w+))?", text)
    if m and m.group(1) in _COMMON:
        common[m.group(2) or m.group(1)] = _COMMON[m.group(1)]
        return
    m = re.fullmatch(r"%import\s+common\s*\(([\w\s,]+)\)", text)
    if m:
        names = [n.strip() for n in m.group(1).split(",") if n.strip()]
        unknown = [n for n in names if n not in _COMMON]
        if not unknown:
            for name in names:
                common[name] = _COMMON[name]
            return
    raise ValueError(f"line {tok.line}: unsupported directive {text!r}")


def convert_lark_to_ebnf(grammar: str) -> str:
    """Rewrite a Lark grammar as xgrammar's EBNF (`root ::= <start rule>` first); ValueError
    naming the line for what has no EBNF form or does not parse."""
    if not grammar.strip():
        raise ValueError("Grammar string cannot be empty")
    rules, directives = _split_rules(_tokenize(grammar))
    if not rules:
        raise ValueError("No valid rules found in grammar")
    common: dict[str, str] = {}
    for tok in directives:
        _directive(tok, common)
    refs: set[str] = set()
    bodies: dict[str, str] = {}
    for rule in rules:
        body = _body(rule, refs)
        # A rule defined twice (Lark allows it for terminals only): alternatives of both.
        bodies[rule.name] = f"{bodies[rule.name]} | {body}" if rule.name in bodies else body
    for name, body in common.items():
        bodies.setdefault(name, body)
    undefined = sorted(refs - set(bodies))
    if undefined:
        raise ValueError(f"Referenced rules are not defined: {', '.join(undefined)}")
    start = "start" if "start" in bodies else rules[0].name
    lines = [f"root ::= {_ebnf_name(start)}"]
    lines += [f"{_ebnf_name(name)} ::= {body}" for name, body in bodies.items()]
    return "\n".join(lines)
