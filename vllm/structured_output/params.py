"""What a request asks its output to match: vLLM's `StructuredOutputsParams` (current API) and
`GuidedDecodingParams` (the 0.6-era API), and their reduction to one `GrammarSpec`.

Imports neither torch nor the grammar engine: `SamplingParams` (torch-free) re-exports these
classes, and the engine compiles the spec (`compiler.py`) only when a request has one.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, NamedTuple

from vllm.structured_output.lark_to_ebnf import convert_lark_to_ebnf, grammar_is_likely_lark

# The constraint fields, in vLLM's order; exactly one of them is set.
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _schema_text(schema: Any) -> str:
    """A JSON schema given as a str, a dict or a pydantic model class, as compact text (the
    compile cache's key). Keys keep their order: it is the order of the generated fields."""
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from exc
    elif hasattr(schema, "model_json_schema"):  # a pydantic BaseModel class
        schema = schema.model_json_schema()
    if not isinstance(schema, (dict, bool)):
        raise ValueError(
            "structured_outputs.json must be a JSON schema (a dict, a JSON string or a pydantic "
            f"model), got {type(schema).__name__}"
        )
    return _json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


@dataclass
class StructuredOutputsParams:
    """At most one constraint on a request's output (vLLM's names): a JSON schema (`json`), a
    regular expression (`regex`), one of a list of strings (`choice`), an EBNF grammar
    (`grammar`), any JSON value (`json_object=True`) or an xgrammar structural tag.

    None set means no constraint (the server fills the object in from `response_format` or
    the tool choice). `disable_any_whitespace` forbids whitespace between JSON tokens (some
    models loop on it); `disable_additional_properties` closes every object of a JSON schema
    that does not say `additionalProperties` itself (vLLM's guidance option);
    `disable_fallback` holds by construction (one backend: nothing to fall back to).
    `whitespace_pattern` (vLLM's outlines option) is refused: xgrammar takes no whitespace
    regex."""

    json: str | dict[str, Any] | Any | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            # A pydantic model class: its schema (a dict pickles to the stages; a class
            # defined in a script might not).
            self.json = self.json.model_json_schema()
        count = sum(getattr(self, kind) is not None for kind in _KINDS)
        if count > 1:
            raise ValueError(
                "You can only use one kind of structured outputs constraint "
                f"but multiple are specified: {self.__dict__}"
            )
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object must be True when given")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of strings")
            self.choice = list(self.choice)
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar "
                "backend; use disable_any_whitespace=True for JSON without whitespace."
            )
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"structured_outputs.{name} must be a string, got {type(value).__name__}"
                )

    def all_constraints_none(self) -> bool:
        """True when no constraint field is set (vLLM's helper)."""
        return all(getattr(self, kind) is None for kind in _KINDS)

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutputsParams:
        """From the server's `structured_outputs` JSON object; unknown keys are refused."""
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields: {sorted(unknown)}")
        return cls(**value)


@dataclass
class GuidedDecodingParams:
    """vLLM 0.6's form of the same constraint (`SamplingParams(guided_decoding=...)`);
    converted to `StructuredOutputsParams` by `SamplingParams`."""

    json: str | dict[str, Any] | Any | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        guide_count = sum(
            getattr(self, kind) is not None
            for kind in ("json", "regex", "choice", "grammar", "json_object")
        )
        if guide_count > 1:
            raise ValueError(
                "You can only use one kind of guided decoding "
                "('json', 'regex', 'choice', 'grammar')."
            )

    @staticmethod
    def from_optional(
        json: str | dict[str, Any] | Any | None = None,
        regex: str | None = None,
        choice: list[str] | None = None,
        grammar: str | None = None,
        json_object: bool | None = None,
        backend: str | None = None,
        whitespace_pattern: str | None = None,
    ) -> GuidedDecodingParams | None:
        """None when no constraint is given (vLLM's helper for the server's guided_* fields)."""
        if all(arg is None for arg in (json, regex, choice, grammar, json_object)):
            return None
        if isinstance(json, str):
            json = _json.loads(json)
        return GuidedDecodingParams(
            json=json,
            regex=regex,
            choice=choice,
            grammar=grammar,
            json_object=json_object,
            backend=backend,
            whitespace_pattern=whitespace_pattern,
        )

    def to_structured_outputs(self) -> StructuredOutputsParams:
        """The same constraint in the current API."""
        return StructuredOutputsParams(
            json=self.json,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
            whitespace_pattern=self.whitespace_pattern,
        )


# JSON Schema keywords whose value is a schema, a list of schemas, or a name -> schema map.
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that does not set `additionalProperties`
    gets `false` (vLLM's disable_additional_properties); const / enum values are untouched."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(item) for item in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarSpec(NamedTuple):
    """What the grammar engine compiles: a kind (`json`, `json_object`, `regex`, `grammar`,
    `structural_tag`) and its text. Hashable: the compile cache's key."""

    kind: str
    text: str
    any_whitespace: bool = True


def _choice_grammar(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes, so json.dumps quotes each choice safely.
    return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in choices)


def _ebnf(grammar: str) -> str:
    """The grammar as xgrammar's EBNF: a Lark grammar is rewritten (vLLM accepts either)."""
    if not grammar_is_likely_lark(grammar):
        return grammar
    try:
        return convert_lark_to_ebnf(grammar)
    except ValueError as exc:
        # vLLM's wording, with the reason: neither EBNF (no `::=`) nor convertible Lark.
        raise ValueError(
            f"Invalid grammar for structured outputs: failed to convert the grammar from Lark "
            f"to EBNF ({exc}). A grammar is EBNF (GBNF, `rule ::= ...`) or Lark (`rule: ...`)."
        ) from None


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """Reduce a request's constraint to the one spec the compiler takes (choice becomes an
    EBNF alternative of literals, as in vLLM's xgrammar backend)."""
    any_ws = not params.disable_any_whitespace
    if params.json is not None:
        schema = params.json
        if params.disable_additional_properties:
            schema = close_objects(_json.loads(schema) if isinstance(schema, str) else schema)
        return GrammarSpec("json", _schema_text(schema), any_ws)
    if params.json_object:
        return GrammarSpec("json_object", "", any_ws)
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.choice is not None:
        return GrammarSpec("grammar", _choice_grammar(params.choice))
    if params.grammar is not None:
        return GrammarSpec("grammar", _ebnf(params.grammar))
    if params.structural_tag is not None:
        return GrammarSpec("structural_tag", params.structural_tag)
    raise ValueError("structured_outputs has no constraint")
