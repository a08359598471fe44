"""Small torch-free helpers shared across the package."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """`a / b` rounded up, for non-negative integers (`b` > 0)."""
    return -(-a // b)
