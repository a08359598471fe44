"""Incremental detokenization and stop-string handling.

Decoding the whole output every step is quadratic; instead each step converts only the new
token and re-renders a short window of previous tokens, so multi-byte characters and
tokenizer-specific spacing come out exactly as a full decode would give them.
"""

from __future__ import annotations

from typing import Any

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


def _token_string(info: TokenizerInfo, token_id: int, skip_special_tokens: bool) -> str | None:
    """The tokenizer's string for one id; None when it is a special token being skipped."""
    if skip_special_tokens and token_id in info.special_ids:
        return None
    token = info.tokenizer.convert_ids_to_tokens([token_id])[0]
    # ids outside the tokenizer's vocab (padded embeddings) render as nothing
    return "" if token is None else token


def _decode_window(
    info: TokenizerInfo,
    window: list[str],
    read_index: int,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> str:
    """Text the last token of `window` adds after window[:read_index] (already emitted), or ""
    while it ends in an incomplete UTF-8 sequence (rendered U+FFFD; the next token ends it)."""
    prefix_text = _convert_tokens_to_string(
        info, window[:read_index], skip_special_tokens, spaces_between_special_tokens
    )
    new_text = _convert_tokens_to_string(
        info, window, skip_special_tokens, spaces_between_special_tokens
    )
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return ""
    return new_text[len(prefix_text) :]


def init_detokenizer_state(info: TokenizerInfo, seq: Sequence, skip_special_tokens: bool) -> None:
    """First call: render the prompt's last few tokens as context for the first output."""
    if seq.tokens is not None:
        return
    prompt_ids = seq.prompt_token_ids[-(_INITIAL_OFFSET + 1) :]
    tokens = (
        info.tokenizer.convert_ids_to_tokens(prompt_ids, skip_special_tokens=skip_special_tokens)
        if prompt_ids
        else []
    )
    # ids beyond the tokenizer's vocab (padded embeddings) have no string
    seq.tokens = ["" if t is None else t for t in tokens]
    seq.prefix_offset = max(len(seq.tokens) - _INITIAL_OFFSET, 0)
    seq.read_offset = len(seq.tokens)


def decode_candidate(
    info: TokenizerInfo,
    seq: Sequence,
    token_id: int,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    """The text `token_id` would add if it were `seq`'s next token (`seq` is not changed):
    the decoded_token of a top-k logprob entry."""
    init_detokenizer_state(info, seq, skip_special_tokens)
    assert seq.tokens is not None
    token = _token_string(info, token_id, skip_special_tokens)
    if token is None:
        return ""
    window = seq.tokens[seq.prefix_offset :] + [token]
    return _decode_window(
        info,
        window,
        seq.read_offset - seq.prefix_offset,
        skip_special_tokens,
        spaces_between_special_tokens,
    )


def detokenize_incrementally(
    info: TokenizerInfo,
    seq: Sequence,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    """Append the text of `seq`'s newest token to its state; returns the new text."""
    init_detokenizer_state(info, seq, skip_special_tokens)
    assert seq.tokens is not None
    token = _token_string(info, seq.get_last_token_id(), skip_special_tokens)
    if token is None:
        return ""
    seq.tokens.append(token)
    new_text = _decode_window(
        info,
        seq.tokens[seq.prefix_offset :],
        seq.read_offset - seq.prefix_offset,
        skip_special_tokens,
        spaces_between_special_tokens,
    )
    if new_text:
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(seq.tokens)
    return new_text


def flush_detokenizer(
    info: TokenizerInfo,
    seq: Sequence,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    drop_last_token: bool = False,
) -> str:
    """The text held back at the end of a finished `seq`: the tokens after its read offset
    that ended inside a multi-byte character. Decoded as a full decode renders them
    (U+FFFD for the incomplete bytes), so the output text equals decoding its token ids.
    `drop_last_token`: the last token is a stop token whose text is not output."""
    if seq.tokens is None:
        return ""
    end = len(seq.tokens)
    last_skipped = skip_special_tokens and seq.get_last_token_id() in info.special_ids
    if drop_last_token and not last_skipped:  # a skipped token never entered seq.tokens
        end -= 1
    if seq.read_offset >= end:
        return ""
    window = seq.tokens[seq.prefix_offset : end]
    read_index = seq.read_offset - seq.prefix_offset
    prefix_text = _convert_tokens_to_string(
        info, window[:read_index], skip_special_tokens, spaces_between_special_tokens
    )
    full_text = _convert_tokens_to_string(
        info, window, skip_special_tokens, spaces_between_special_tokens
    )
    seq.prefix_offset = seq.read_offset
    seq.read_offset = end
    return full_text[len(prefix_text) :]


def decode_prompt_logprobs(
    info: TokenizerInfo,
    prompt_token_ids: list[int],
    prompt_logprobs: list[dict[int, Any] | None],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> None:
    """Fill `decoded_token` of every prompt logprob entry: the text each candidate would add
    after the prompt tokens before it (the actual tokens' texts join to the prompt text)."""
    tokens: list[str] = []
    prefix_offset = read_offset = 0
    for position, token_id in enumerate(prompt_token_ids):
        entry = prompt_logprobs[position] if position < len(prompt_logprobs) else None
        read_index = read_offset - prefix_offset
        actual_text = ""
        for candidate, logprob in (entry or {}).items():
            token = _token_string(info, candidate, skip_special_tokens)
            text = ""
            if token is not None:
                window = tokens[prefix_offset:] + [token]
                text = _decode_window(
                    info, window, read_index, skip_special_tokens, spaces_between_special_tokens
                )
            logprob.decoded_token = text
            if candidate == token_id:
                actual_text = text
        # Advance the state along the real prompt.
        token = _token_string(info, token_id, skip_special_tokens)
        if token is None:
            continue
        tokens.append(token)
        if entry is None:
            actual_text = _decode_window(
                info,
                tokens[prefix_offset:],
                read_index,
                skip_special_tokens,
                spaces_between_special_tokens,
            )
        if actual_text:
            prefix_offset = read_offset
            read_offset = len(tokens)


def check_stop_strings(
    seq: Sequence, new_char_count: int, stop: list[str], include_stop_str: bool
) -> str | None:
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
