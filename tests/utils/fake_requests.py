"""Torch-free stand-ins shared by the block-manager and scheduler unit tests."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

# Sequence ids, unique across every test module that builds fake sequences.
seq_ids = itertools.count()


@dataclass
class FakeParams:
    """The few sampling-params fields the block manager and scheduler read."""

    n: int = 1
    best_of: int = 1
    use_beam_search: bool = False
    max_tokens: int | None = 16
    prompt_logprobs: int | None = None
