"""`ChunkSizer`: how many prompt tokens a prefill chunk takes, so every step costs about the same.

A chunk's cost grows with where it starts: its tokens run the same linear layers wherever
they are, but each one also attends over every token before it. With a fixed chunk size
the last chunks of a 4k prompt cost ~2x the first ones (SmolLM2: attention over 4k keys
costs about as much as its linear layers). In a pipeline the step time is set by the
slowest micro-batch on the slowest stage and the pipeline drains on the last chunk, so
uneven chunks are paid twice: the first stage waits behind an expensive chunk, and the
last, most expensive chunk alone runs the final stages. A decode next to that chunk waits as
long as the chunk takes.

The sizer keeps one cost model for a step, in seconds,

    t = c0 + a * tokens + b * pairs        (pairs: query-key pairs the attention scores)

and gives a chunk starting at position p the size n whose cost a*n + b*n*(p + (n+1)/2)
equals the cost of the step's room in tokens at position 0: every chunk then costs what the
first one did (SGLang's dynamic chunking, with its cost taken from this engine's own steps).
Only the ratio r = b / a matters. It starts from the model's arithmetic (`prior_pair_cost`)
and is measured while serving: the engine reports each finished step's tokens, pairs and
duration (`observe`), and a least-squares fit over the last steps replaces the prior once the
steps vary enough to tell the three terms apart, within a factor of 4 of it either way (a
loaded machine makes single timings noisy; the prior is right in kind). Imports no torch.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

# A chunk is never cut below this many tokens, nor below this share of the step's room (a
# small chunk costs a whole step's overhead, and a bad fit must not shred a prompt).
MIN_CHUNK = 32
MIN_SHARE = 0.125
# Steps in the fit's window, and the fewest that make a fit.
WINDOW = 64
MIN_SAMPLES = 8
# How far the measured ratio may move from the prior, either way.
MAX_DRIFT = 4.0
# The share of the timings' variance the fit must explain to be used (noise from other
# processes on the machine makes the rest).
MIN_R2 = 0.8


@dataclass(frozen=True)
class StepCost:
    """The work of one step: tokens fed (linear layers) and query-key pairs scored."""

    tokens: int
    pairs: int

    @staticmethod
    def chunk_pairs(start: int, tokens: int) -> int:
        """Query-key pairs of a causal chunk of `tokens` tokens starting at position `start`
        (query i sees keys 0 .. start + i)."""
        return tokens * start + tokens * (tokens + 1) // 2


def prior_pair_cost(layer_weights: int, num_heads: int, head_size: int) -> float:
    """The attention cost of one query-key pair in units of one token's linear cost, from a
    decoder layer's arithmetic: the scores and the weighted sum take 4 * heads * head_size
    flops a pair; the matmuls (`layer_weights` weights a token runs through, see
    `ModelConfig.get_gemm_shapes`) take 2 flops per weight."""
    return (4 * num_heads * head_size) / (2 * layer_weights)


class ChunkSizer:
    """Sizes prefill chunks to an even step cost (see the module docstring)."""

    def __init__(self, prior: float) -> None:
        if not prior > 0:
            raise ValueError(f"prior pair cost must be > 0, got {prior}.")
        self.prior = prior
        self.ratio = prior
        self._samples: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=WINDOW)

    def chunk(self, start: int, new_tokens: int, room: int) -> int:
        """Tokens of a chunk starting at position `start`, with `new_tokens` left to prefill
        and `room` tokens left in the step: at most both, and no more than costs what `room`
        tokens cost at position 0 (never below MIN_CHUNK unless less is left or fits)."""
        limit = min(new_tokens, room)
        if limit <= 0:
            return max(0, limit)
        r = self.ratio
        # The cost of `room` tokens at position 0, in token units (a = 1, b = r).
        target = room + r * StepCost.chunk_pairs(0, room)
        # n + r * chunk_pairs(start, n) = target: (r/2) n^2 + (1 + r (start + 1/2)) n = target.
        lin = 1.0 + r * (start + 0.5)
        n = (-lin + math.sqrt(lin * lin + 2.0 * r * target)) / r
        # Rounding: a chunk at position 0 takes the whole room.
        return min(limit, max(int(n + 1e-6), MIN_CHUNK, int(room * MIN_SHARE)))

    def observe(self, cost: StepCost, seconds: float) -> None:
        """A finished step took `seconds` on the pipeline's slowest stage: refit the ratio."""
        if cost.tokens <= 0 or not seconds > 0:
            return
        self._samples.append((cost.tokens, cost.pairs, seconds))
        if len(self._samples) >= MIN_SAMPLES:
            fitted = _fit_ratio(list(self._samples))
            if fitted is not None:
                self.ratio = min(self.prior * MAX_DRIFT, max(self.prior / MAX_DRIFT, fitted))


def _fit_ratio(samples: list[tuple[int, int, float]]) -> float | None:
    """b / a of the least-squares fit t = c0 + a*tokens + b*pairs, or None when the samples
    cannot tell the terms apart (too little spread), the fit is not physical (a, b <= 0) or
    explains too little of the timings (R^2 < MIN_R2)."""
    n = len(samples)
    # Normal equations of the centred problem: c0 drops out.
    mt = sum(s[0] for s in samples) / n
    mp = sum(s[1] for s in samples) / n
    my = sum(s[2] for s in samples) / n
    stt = sum((s[0] - mt) ** 2 for s in samples)
    spp = sum((s[1] - mp) ** 2 for s in samples)
    stp = sum((s[0] - mt) * (s[1] - mp) for s in samples)
    sty = sum((s[0] - mt) * (s[2] - my) for s in samples)
    spy = sum((s[1] - mp) * (s[2] - my) for s in samples)
    det = stt * spp - stp * stp
    # Nearly collinear tokens and pairs (e.g. every step the same chunk at the same place).
    if stt <= 0 or spp <= 0 or det <= 1e-6 * stt * spp:
        return None
    a = (sty * spp - spy * stp) / det
    b = (spy * stt - sty * stp) / det
    if a <= 0 or b <= 0:
        return None
    syy = sum((s[2] - my) ** 2 for s in samples)
    residual = sum((s[2] - my - a * (s[0] - mt) - b * (s[1] - mp)) ** 2 for s in samples)
    if syy <= 0 or 1.0 - residual / syy < MIN_R2:
        return None
    return b / a
