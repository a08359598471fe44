"""Which sequences of a step speculate, and with which drafts (the engine side). Imports no
torch.

The scheduler asks `DraftPlanner.plan` for each decode it scheduled; the planner proposes
drafts (prompt lookup), caps them so a step never runs past `max_tokens` or the context
window, and pauses speculation while it does not pay: above `disable_by_batch_size` running
sequences (vLLM's rule), and while the measured acceptance is too low to pay for the longer
verify steps (logged when it switches).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vllm.logger import init_logger
from vllm.spec_decode.ngram import propose_ngram

if TYPE_CHECKING:
    from vllm.sequence import Sequence, SequenceGroup
    from vllm.spec_decode.config import SpeculativeConfig

logger = init_logger("vllm.spec_decode")

# Acceptance below this many accepted tokens per proposed token, over the last
# `_WINDOW` proposed tokens, pauses speculation for `_PAUSE_STEPS` steps: a verify step of
# k+1 tokens per sequence then costs more than the tokens it gains.
_MIN_ACCEPTANCE = 0.1
# Running sequences above which speculation pauses when `disable_by_batch_size` is not set
# (vLLM would never pause): a verify step adds k tokens per sequence, which is nearly free
# while a step is bound by reading the weights, and costs as much as decoding them once the
# batch makes it compute-bound. Measured on the 2-core CPU (`benchmarks.spec_decode --batch
# 64`, SmolLM2 Q4_1, prompt lookup k=3): 0.80x the tokens/s of no speculation at 64 requests.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
_WINDOW = 256
_PAUSE_STEPS = 64


@dataclass
class SpecOutcome:
    """What the speculative decodes of one step (or of a run, added up) proposed and got
    accepted, in vLLM's metric terms."""

    num_drafts: int = 0  # sequences that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Index i: drafts accepted at position i (the i-th draft of a sequence).
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, other: SpecOutcome) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, count in enumerate(other.accepted_per_pos):
            if i == len(self.accepted_per_pos):
                self.accepted_per_pos.append(0)
            self.accepted_per_pos[i] += count

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def step_outcome(
    drafts: dict[str, dict[int, list[int]]], groups: list[Any], output: Any
) -> SpecOutcome:
    """The outcome of one step's speculative decodes: `drafts` as scheduled (request id ->
    seq id -> drafts), `groups` the step's groups and `output` its sampler output (in step
    order; a sample's `accepted` lists the drafts the target confirmed)."""
    outcome = SpecOutcome()
    for group, group_output in zip(groups, output or ()):
        planned = drafts.get(group.request_id)
        if not planned or getattr(group_output, "error", None) is not None:
            continue
        for sample in group_output.samples:
            proposed = planned.get(sample.parent_seq_id)
            if not proposed:
                continue
            accepted = len(sample.accepted or ())
            outcome.num_drafts += 1
            outcome.num_draft_tokens += len(proposed)
            outcome.num_accepted_tokens += accepted
            while len(outcome.accepted_per_pos) < len(proposed):
                outcome.accepted_per_pos.append(0)
            for i in range(accepted):
                outcome.accepted_per_pos[i] += 1
    return outcome


class Proposer(Protocol):
    """Where drafts come from: prompt lookup, or a draft model (`vllm.spec_decode.draft_model`,
    built by the engine)."""

    # Whether proposing costs next to nothing (then the scheduler may propose just to decide
    # whether a decode should wait for its token rather than go ahead without drafts).
    cheap: bool

    @property
    def active(self) -> bool:
        """Whether it proposes at all (a draft model that failed for good does not)."""
        ...

    def propose(self, requests: list[tuple[str, int, list[int], int]]) -> list[list[int]]:
        """For each (request id, seq id, token ids, k): up to k draft tokens that may follow
        the token ids."""
        ...

    def release(self, request_ids: list[str]) -> None:
        """Finished or aborted requests: whatever is kept for their sequences goes."""
        ...

    def shutdown(self) -> None:
        """Release what the proposer runs on (a draft model's rank)."""
        ...


class NgramProposer:
    """Prompt lookup (`propose_ngram`): no model, microseconds per sequence."""

    cheap = True

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lookup_max = config.prompt_lookup_max
        self.lookup_min = config.prompt_lookup_min

    @property
    def active(self) -> bool:
        return True

    def propose(self, requests: list[tuple[str, int, list[int], int]]) -> list[list[int]]:
        return [
            propose_ngram(ids, k, self.lookup_max, self.lookup_min) for _, _, ids, k in requests
        ]

    def release(self, request_ids: list[str]) -> None:
        pass  # nothing kept

    def shutdown(self) -> None:
        pass  # nothing runs


class DraftPlanner:
    """Proposes the draft tokens of each speculating sequence; owns the on/off state."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: Proposer = proposer if proposer is not None else NgramProposer(config)
        # (proposed, accepted) per verified sequence, newest last.
        self._recent: collections.deque[tuple[int, int]] = collections.deque()
        self._recent_proposed = 0
        self._recent_accepted = 0
        self._paused_steps = 0
        self._batch_paused = False
        # Everything proposed and accepted since the engine started.
        self.totals = SpecOutcome()

    def begin_step(self, num_running_seqs: int) -> bool:
        """A new step is being scheduled with `num_running_seqs` running: whether its decodes
        may speculate."""
        limit = self.config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE
        over = num_running_seqs > limit
        if over != self._batch_paused:
            self._batch_paused = over
            logger.info(
                "Speculative decoding %s: %d running sequences (disable_by_batch_size=%s)",
                "paused" if over else "resumed",
                num_running_seqs,
                limit,
            )
        if self._paused_steps > 0:
            self._paused_steps -= 1
            if self._paused_steps == 0:
                logger.info("Speculative decoding resumed after a pause for low acceptance")
            return False
        return not over

    def shutdown(self) -> None:
        """Release the proposer's resources (a draft model's rank); safe to call twice."""
        self.proposer.shutdown()

    def draft_limit(self, group: SequenceGroup, seq: Sequence) -> int:
        """How many drafts `seq` may verify in this step (0: none)."""
        params = group.sampling_params
        if params.use_beam_search or group.pooling_params is not None:
            return 0
        # The step yields up to k + 1 tokens: never past max_tokens or the context window.
        room = self.max_model_len - seq.get_len()
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.get_output_len() - 1)
        return max(0, min(self.config.num_speculative_tokens, room))

    def propose(self, seqs: list[tuple[SequenceGroup, Sequence]]) -> list[list[int]]:
        """The drafts of each (group, sequence) in this step ([] for none), in one call of
        the proposer (a draft model runs them as one batch)."""
        limits = [self.draft_limit(group, seq) for group, seq in seqs]
        asked = [
            (group.request_id, seq.seq_id, seq.get_token_ids(), k)
            for (group, seq), k in zip(seqs, limits)
            if k > 0
        ]
        found = iter(self.proposer.propose(asked) if asked else [])
        return [next(found)[:k] if k > 0 else [] for k in limits]

    def drafts_for(self, group: SequenceGroup, seq: Sequence) -> list[int]:
        """The drafts of one sequence in this step ([] for none)."""
        return self.propose([(group, seq)])[0]

    def would_speculate(self, group: SequenceGroup, seq: Sequence) -> bool:
        """Whether `seq` would verify drafts if scheduled now (prompt lookup is asked; a
        draft model is assumed to find some)."""
        if self.draft_limit(group, seq) < 1:
            return False
        if not self.proposer.cheap:
            return self.proposer.active
        return bool(self.drafts_for(group, seq))

    def release(self, request_ids: list[str]) -> None:
        """Finished or aborted requests (as the stages are told): the proposer forgets
        their sequences (a draft model frees their draft KV)."""
        if request_ids:
            self.proposer.release(request_ids)

    def observe(self, outcome: SpecOutcome) -> None:
        """A step's speculative decodes came back: count them, and pause speculation while
        too few drafts are accepted."""
        self.totals.add(outcome)
        if outcome.num_draft_tokens:
            self._record(outcome.num_draft_tokens, outcome.num_accepted_tokens)

    def _record(self, proposed: int, accepted: int) -> None:
        self._recent.append((proposed, accepted))
        self._recent_proposed += proposed
        self._recent_accepted += accepted
        while self._recent_proposed - self._recent[0][0] >= _WINDOW:
            old_proposed, old_accepted = self._recent.popleft()
            self._recent_proposed -= old_proposed
            self._recent_accepted -= old_accepted
        if self._recent_proposed < _WINDOW or self._paused_steps:
            return
        rate = self._recent_accepted / self._recent_proposed
        if rate < _MIN_ACCEPTANCE:
            logger.info(
                "Speculative decoding paused for %d steps: %.1f%% of the last %d draft tokens "
                "were accepted",
                _PAUSE_STEPS,
                100 * rate,
                self._recent_proposed,
            )
            self._paused_steps = _PAUSE_STEPS
            self._recent.clear()
            self._recent_proposed = self._recent_accepted = 0
