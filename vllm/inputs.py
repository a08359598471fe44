"""Prompt inputs with vLLM's names: a string, a TextPrompt, a TokensPrompt (torch-free).

`PromptInputs` is what `LLM.generate` and `AsyncLLMEngine.generate` take for one prompt.
"""

from __future__ import annotations

from typing import Any, TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str
    multi_modal_data: NotRequired[Any]


class TokensPrompt(TypedDict):
    """A prompt given as token ids (`prompt` is optional text kept with it)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[Any]
    # An encoder's segment ids for a pair input (score / rerank); pooling requests only.
    token_type_ids: NotRequired[list[int]]


PromptInputs = str | TextPrompt | TokensPrompt
PromptStrictInputs = PromptInputs  # vLLM 0.5's other name for it

__all__ = ["PromptInputs", "PromptStrictInputs", "TextPrompt", "TokensPrompt", "parse_prompt"]


def is_token_list(value: Any) -> bool:
    """A non-empty list (or tuple) of ints: one prompt's token ids."""
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def parse_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt input; exactly what the engine's add_request takes."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if prompt.get("multi_modal_data") is not None:
            raise ValueError("multi_modal_data is not supported by this engine.")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError(
            f"a prompt dict needs a 'prompt' or 'prompt_token_ids' key, got {sorted(prompt)}."
        )
    if is_token_list(prompt):
        return None, list(prompt)
    raise TypeError(
        "a prompt must be a str, a TextPrompt, a TokensPrompt or a list of token ids, got "
        f"{type(prompt).__name__}."
    )
