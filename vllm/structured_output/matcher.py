"""The token mask of structured outputs, applied on the sampling rank (the last stage's TP
driver) to the logits of each constrained sequence before sampling.

Where the matcher lives, and why: one xgrammar matcher per *sequence*, held by the rank that
samples, keyed by seq id, and kept in step with the token ids that rank's `RequestTable`
holds for the sequence. Before each mask the matcher consumes the output tokens it has not seen
yet. Those are exactly the tokens this rank sampled itself, already appended by the step
message even for decodes scheduled ahead of their previous output (asynchronous scheduling), so
the matcher advances with what this rank samples and never waits for the engine. The same rule
covers everything else: a sequence forked by `n`/`best_of` gets its own matcher, which replays
the fork's tokens; a stage that replaced a lost one receives each request in full and replays
its committed output tokens; a preempted or recomputed sequence keeps its tokens; a prefill chunk
that samples nothing is not masked.

A finished grammar allows only the stop tokens (EOS), so reaching its end ends the sequence, and
EOS is allowed only where the grammar may end.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from vllm.logger import init_logger
from vllm.model_executor.sampling_metadata import SamplingMetadata, SeqGroupRows
from vllm.sequence import SequenceData, SequenceGroupMetadata
from vllm.structured_output.compiler import GrammarCompileCache
from vllm.structured_output.params import grammar_spec

logger = init_logger(__name__)


class SequenceMatcher:
    """One sequence's grammar state and the output tokens it has consumed."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.consumed: list[int] = []
        # The stage's SequenceData the tokens were read from: when a new object arrives (the
        # request was re-sent in full), its tokens are compared with what was consumed.
        self._source: SequenceData | None = None
        # A token the grammar refused (only possible if a token was not sampled under this
        # mask, e.g. with ignore_eos past the end): masking stops for the sequence.
        self.broken = False

    def sync(self, data: SequenceData, num_drafts: int = 0) -> bool:
        """Consume the sequence's output tokens not consumed yet, rolling back the ones that
        are no longer there (draft tokens a speculative step rejected). The last
        `num_drafts` tokens are drafts (a speculative step's row after them): a draft the
        grammar refuses is not consumed and False is returned -- that row needs no mask, as
        the draft is rejected at its own position, whose row was masked."""
        tokens = data.output_token_ids
        n = len(self.consumed)
        if data is not self._source or len(tokens) < n:
            self._source = data
            common = _common_prefix(self.consumed, tokens)
            if common < n:
                self._rollback(n - common)
                n = common
        first_draft = len(tokens) - num_drafts
        for index in range(n, len(tokens)):
            token = tokens[index]
            if self.broken:
                self.consumed.append(token)
                continue
            if self.matcher.accept_token(token):
                self.consumed.append(token)
                continue
            if index >= first_draft:
                return False
            self.consumed.append(token)
            self.broken = True
            logger.warning(
                "structured outputs: token %d does not follow the grammar; the rest of this "
                "sequence is not constrained",
                token,
            )
        return True

    def _rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` consumed tokens."""
        if self.broken:
            # Tokens after the refused one were never given to the matcher: start over.
            tokens = self.consumed[: len(self.consumed) - num_tokens]
            self.matcher.reset()
            self.consumed, self.broken = [], False
            for token in tokens:
                self.consumed.append(token)
                if not self.broken and not self.matcher.accept_token(token):
                    self.broken = True
            return
        self.matcher.rollback(num_tokens)
        del self.consumed[len(self.consumed) - num_tokens :]


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _stop_only_row(bitmask: torch.Tensor, row: int, stop_ids: list[int]) -> None:
    """Allow only the stop tokens in a bitmask row (int32 words, bit i of word w = token
    32*w + i)."""
    bitmask[row].zero_()
    for token in stop_ids:
        word, bit = divmod(token, 32)
        value = 1 << bit
        if value >= 1 << 31:  # the sign bit of an int32 word
            value -= 1 << 32
        bitmask[row, word] |= value


class StructuredOutputState:
    """The sampling rank's grammars (per request) and matchers (per sequence)."""

    def __init__(self, cache: GrammarCompileCache) -> None:
        self.cache = cache
        self._grammars: dict[str, Future[Any]] = {}
        self._matchers: dict[str, dict[int, SequenceMatcher]] = {}

    def prefetch(self, metadata_list: list[SequenceGroupMetadata]) -> None:
        """Start compiling the grammars of requests new to this rank, in the background: the
        compile overlaps the step's forward pass."""
        for meta in metadata_list:
            params = meta.sampling_params.structured_outputs
            if params is not None and meta.request_id not in self._grammars:
                self._grammars[meta.request_id] = self.cache.compile_async(grammar_spec(params))

    def _compiled(self, group: SeqGroupRows) -> Any:
        future = self._grammars.get(group.request_id)
        if future is None:
            params = group.params.structured_outputs
            assert params is not None  # only constrained groups are masked
            future = self._grammars[group.request_id] = self.cache.compile_async(
                grammar_spec(params)
            )
        return future.result()

    def apply(self, logits: torch.Tensor, md: SamplingMetadata) -> None:
        """Mask, in place, the sample rows of constrained groups in `logits` [S, V]."""
        import xgrammar as xgr

        bitmask: torch.Tensor | None = None  # [S, ceil(V / 32)] int32
        masked_rows: list[int] = []
        for group in md.groups:
            if group.params.structured_outputs is None or not group.rows:
                continue
            compiled = self._compiled(group)
            matchers = self._matchers.setdefault(group.request_id, {})
            if not group.verify_row and len(matchers) > len(group.seq_ids):
                # Forks that finished: drop theirs (a speculative row holds one sequence of
                # its request: the others are still there).
                for seq_id in matchers.keys() - set(group.seq_ids):
                    del matchers[seq_id]
            for seq_id, row in zip(group.seq_ids, group.rows):
                matcher = matchers.get(seq_id)
                if matcher is None:
                    matcher = matchers[seq_id] = SequenceMatcher(compiled)
                if not matcher.sync(group.seq_data[seq_id], group.num_drafts):
                    continue  # after a refused draft: the row's token is never used
                if matcher.broken:
                    continue
                if bitmask is None:
                    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
                if matcher.matcher.is_terminated():
                    _stop_only_row(bitmask, row, list(matcher.matcher.stop_token_ids))
                else:
                    matcher.matcher.fill_next_token_bitmask(bitmask, row)
                masked_rows.append(row)
        if bitmask is not None and masked_rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=masked_rows)

    def drop(self, request_ids: list[str]) -> None:
        """Finished or aborted requests."""
        for request_id in request_ids:
            self._grammars.pop(request_id, None)
            self._matchers.pop(request_id, None)

    def clear(self) -> None:
        self._grammars.clear()
        self._matchers.clear()
