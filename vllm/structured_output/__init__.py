"""Structured outputs: a request's output constrained to a JSON schema, regex, choice or
grammar (xgrammar). `params` (torch-free) says what a request asks for; `compiler` compiles it
once per spec; `matcher` masks the logits on the sampling rank."""

from vllm.structured_output.params import (
    GrammarSpec,
    GuidedDecodingParams,
    StructuredOutputsParams,
    grammar_spec,
)

__all__ = ["GrammarSpec", "GuidedDecodingParams", "StructuredOutputsParams", "grammar_spec"]
