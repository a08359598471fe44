"""Tool calls read from JSON text that may still be growing (a stream's output so far).

A call is an object with a name key and an arguments key (`{"name": ..., "arguments": {...}}`),
at the top level of the text or inside a top-level array; several may follow one another
(separated by anything that is not JSON, such as `;`). The arguments are the raw text the
model wrote for their value, so the text read from a prefix of the output is a prefix of the
text read from the whole: a stream can send each piece once and never take one back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class PartialCall:
    """One call as far as the text goes: its name once the name's string is closed, and the
    arguments' text so far (`done` once their value is closed)."""

    name: str | None = None
    arguments: str = ""
    done: bool = False
    has_arguments: bool = False


def _string_end(text: str, start: int) -> int | None:
    """Index just after the string literal opening at `start`; None if it is not closed."""
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


class _Reader:
    """The scan of one text: a stack of open containers and the call being read."""

    def __init__(self, text: str, name_key: str, argument_keys: tuple[str, ...]) -> None:
        self.text = text
        self.name_key = name_key
        self.argument_keys = argument_keys
        self.calls: list[PartialCall] = []
        self.stack: list[str] = []
        self.call: PartialCall | None = None
        self.call_depth = 0  # len(stack) inside the call object
        self.expect_key = False
        self.key: str | None = None
        self.value_key: str | None = None  # the member whose value is being read
        self.args_start: int | None = None

    def at_members(self) -> bool:
        return self.call is not None and len(self.stack) == self.call_depth

    def string(self, start: int, end: int) -> None:
        if not self.at_members():
            return
        value = json.loads(self.text[start:end], strict=False)
        assert self.call is not None
        if self.expect_key:
            self.key, self.expect_key = value, False
        elif self.value_key == self.name_key and isinstance(value, str):
            self.call.name = value
        elif self.value_key in self.argument_keys:
            # Arguments given as a JSON string: they are that string's content, whole.
            self.call.arguments, self.call.done, self.call.has_arguments = value, True, True

    def open(self, index: int, char: str) -> None:
        top_level = not self.stack or self.stack == ["["]
        if self.call is None and char == "{" and top_level:
            self.call = PartialCall()
            self.calls.append(self.call)
            self.call_depth = len(self.stack) + 1
            self.value_key = None
        elif self.at_members() and self.value_key in self.argument_keys:
            self.args_start = index
            assert self.call is not None
            self.call.has_arguments = True
        self.stack.append(char)
        if self.at_members():
            self.expect_key = True

    def close(self, index: int) -> None:
        if self.stack:
            self.stack.pop()
        if self.call is None:
            return
        if self.at_members() and self.args_start is not None and not self.call.done:
            self.call.arguments = self.text[self.args_start : index + 1]
            self.call.done = True
            self.args_start = None
        elif len(self.stack) < self.call_depth:
            self.call = None

    def punctuation(self, char: str) -> None:
        if not self.at_members():
            return
        if char == ",":
            self.expect_key, self.value_key = True, None
        elif char == ":":
            self.value_key = self.key

    def run(self) -> list[PartialCall]:
        text, i = self.text, 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    break
                self.string(i, end)
                i = end
                continue
            if c in "{[":
                self.open(i, c)
            elif c in "}]":
                self.close(i)
            elif c in ",:":
                self.punctuation(c)
            i += 1
        if self.call is not None and self.args_start is not None and not self.call.done:
            self.call.arguments = text[self.args_start :]
        return self.calls


def scan_calls(
    text: str, argument_keys: tuple[str, ...] = ("arguments", "parameters"), name_key: str = "name"
) -> list[PartialCall]:
    """The calls in `text` (possibly cut anywhere), in order."""
    return _Reader(text, name_key, argument_keys).run()
