"""Reasoning parsers (`--reasoning-parser`): a think-tag model's `<think>...</think>` becomes the
message's `reasoning_content`, the rest its `content` (and what the tool parser reads).

`deepseek_r1`: the template opens `<think>` itself, so text before `</think>` is reasoning even
without an opening tag, and an output that never closes it is all reasoning. `qwen3`: reasoning
only between an explicit `<think>` and `</think>`; without the tags everything is content.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    """Splits an output into (reasoning, content)."""

    implicit_start = False

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content) of the text so far; before the end (`final` False) a
        tail that may be the start of a tag is held back from both."""
        body = text
        stripped = body.lstrip()
        if not final and stripped and len(stripped) < len(START) and START.startswith(stripped):
            return None, ""  # may still open a think block
        if stripped.startswith(START):
            body = stripped[len(START) :]
        elif not self.implicit_start:
            return None, text
        if END in body:
            reasoning, _, content = body.partition(END)
            return reasoning, content.lstrip("\n")
        if not final:
            for k in range(len(END) - 1, 0, -1):
                if body.endswith(END[:k]):
                    body = body[:-k]
                    break
        return body, ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    implicit_start = True


class Qwen3ReasoningParser(ReasoningParser):
    implicit_start = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise KeyError(f"reasoning parser: '{name}' not found in reasoning_parsers")
    return REASONING_PARSERS[name]()
