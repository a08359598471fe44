"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of
the sequence's last n tokens. Imports no torch."""

from __future__ import annotations

from array import array

_WIDTH = array("i").itemsize  # bytes per token id in the searched buffer


def propose_ngram(token_ids: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to `k` guessed next tokens of `token_ids` (prompt and output), or [] when no n-gram
    of `lookup_max` down to `lookup_min` tokens at the end occurred before.

    The longest suffix that matches wins (a longer match predicts better); among its
    occurrences the latest one (the most recent context, as in text being copied). A match
    overlapping the suffix itself is allowed: repeated text proposes its own repetition.
    The search runs over the ids' bytes (`bytes.rfind`, in C): a step proposes for every
    running sequence, so a Python loop over 4k-token contexts would cost milliseconds each.
    """
    length = len(token_ids)
    if k < 1 or length < 2:
        return []

    buf = array("i", token_ids).tobytes()
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        pattern = buf[(length - n) * _WIDTH :]
        # A match must start at or before token length - n - 1 (an EARLIER occurrence).
        end = (length - 1) * _WIDTH
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % _WIDTH == 0:  # aligned on a token, not inside two ids' bytes
                return _copy_after(token_ids, at // _WIDTH + n, k)
            end = at + len(pattern) - 1
    return []


def _copy_after(token_ids: list[int], start: int, k: int) -> list[int]:
    """The k tokens from `start` on, where a copy that runs past the end goes on from what it
    has proposed so far (LZ77's overlapping copy): a match just before the end means text
    repeating with a short period, and the period goes on."""
    period = len(token_ids) - start
    follow = token_ids[start : start + k]
    while len(follow) < k:
        follow.append(follow[len(follow) - period])
    return follow
