"""Incremental detokenization and stop-string handling.

Decoding the whole output every step is quadratic; instead each step converts only the new
token and re-renders a short window of previous tokens, so multi-byte characters and
tokenizer-specific spacing come out exactly as a full decode would give them.
"""

from __future__ import annotations

from typing import Any, Optional

from vllm.sequence import Sequence

# Prompt tokens kept before the read offset, so the first output token has context.
_INITIAL_OFFSET = 5


class TokenizerInfo:
    """A tokenizer plus its special tokens as sets (HF recomputes them on every access)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = set(tokenizer.all_special_ids)
        # Added tokens flagged special (e.g. SmolLM2's <jupyter_output>) are skipped by HF's
        # decode(skip_special_tokens=True) too, though all_special_ids may not list them.
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
        self.special_tokens = set(tokenizer.all_special_tokens)
        self.special_tokens.update(tokenizer.convert_ids_to_tokens(sorted(self.special_ids)))


def _convert_tokens_to_string(
    info: TokenizerInfo,
    tokens: list[str],
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> str:
    if not tokens:
        return ""
    tokenizer = info.tokenizer
    special = info.special_tokens
    if not special.intersection(tokens) or (skip_special_tokens and spaces_between_special_tokens):
        if skip_special_tokens:
            tokens = [t for t in tokens if t not in special]
        return tokenizer.convert_tokens_to_string(tokens)
    # Special tokens are rendered verbatim, between decoded runs of ordinary tokens.
    pieces: list[str] = []
    run: list[str] = []
    for token in tokens:
        if token in special:
            if skip_special_tokens:
                continue
            if run:
                pieces.append(tokenizer.convert_tokens_to_string(run))
                run = []
            pieces.append(token)
        else:
            run.append(token)
    if run:
        pieces.append(tokenizer.convert_tokens_to_string(run))
    return (" " if spaces_between_special_tokens else "").join(pieces)


def detokenize_incrementally(
    info: TokenizerInfo,
    seq: Sequence,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    """Append the text of `seq`'s newest token to its state; returns the new text."""
    tokenizer = info.tokenizer
    all_ids = seq.get_token_ids()
    if seq.tokens is None:
        # First call: render the prompt's last few tokens as context for the first output.
        prompt_ids = all_ids[: seq.get_prompt_len()][-(_INITIAL_OFFSET + 1) :]
        seq.tokens = (
            list(
                tokenizer.convert_ids_to_tokens(prompt_ids, skip_special_tokens=skip_special_tokens)
            )
            if prompt_ids
            else []
        )
        seq.prefix_offset = max(len(seq.tokens) - _INITIAL_OFFSET, 0)
        seq.read_offset = len(seq.tokens)
    new_id = all_ids[-1]
    if skip_special_tokens and new_id in info.special_ids:
        return ""
    new_token = tokenizer.convert_ids_to_tokens([new_id])[0]
    if new_token is None:  # ids outside the tokenizer's vocab (padded embeddings)
        new_token = ""
    seq.tokens.append(new_token)
    prefix_text = _convert_tokens_to_string(
        info,
        seq.tokens[seq.prefix_offset : seq.read_offset],
        skip_special_tokens,
        spaces_between_special_tokens,
    )
    new_text = _convert_tokens_to_string(
        info,
        seq.tokens[seq.prefix_offset :],
        skip_special_tokens,
        spaces_between_special_tokens,
    )
    # An incomplete UTF-8 sequence renders as U+FFFD: wait for the next token to finish it.
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return ""
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(seq.tokens)
    return new_text[len(prefix_text) :]


def check_stop_strings(
    seq: Sequence, new_char_count: int, stop: list[str], include_stop_str: bool
) -> Optional[str]:
    """If a stop string appears in text new this step (or straddling into it), cut the output
    there (keeping the string if asked) and return it."""
    if not stop or new_char_count <= 0:
        return None
    text = seq.output_text
    for stop_str in stop:
        # Only the last new chars (plus the stop string's own length) can hold a new match.
        start = max(len(text) - new_char_count - len(stop_str) + 1, 0)
        index = text.find(stop_str, start)
        if index == -1:
            continue
        end = index + len(stop_str) if include_stop_str else index
        seq.output_text = text[:end]
        return stop_str
    return None
