"""`MicroBatchBudget`: how large one scheduled batch may be, decided once by the engine.

With pipeline parallelism the engine keeps several micro-batches in the pipeline (one per
stage, or `VLLM_PP_MICRO_BATCHES` of them: the *cohorts*), and each scheduled batch takes about
one cohort's share of the work, so every stage has a batch to run. The same number sizes the
batch queue and the distance a decode scheduled ahead keeps from its step in flight. Imports
no torch.
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass

from vllm import envs
from vllm.config import SchedulerConfig
from vllm.utils import ceil_div

# No cap: a step may take every sequence the other budgets allow.
NO_CAP = 1 << 62


@dataclass(frozen=True)
class MicroBatchBudget:
    """The limits of one scheduled batch: `cohorts` micro-batches share the pipeline, within
    `max_num_seqs` running sequences and `max_num_batched_tokens` tokens per step."""

    cohorts: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        if self.cohorts < 1:
            raise ValueError(f"cohorts must be >= 1, got {self.cohorts}.")

    @classmethod
    def from_config(cls, scheduler_config: SchedulerConfig, cohorts: int = 1) -> MicroBatchBudget:
        """The budget of `scheduler_config` split into `cohorts` micro-batches."""
        return cls(cohorts, scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens)

    @classmethod
    def for_pipeline(
        cls, scheduler_config: SchedulerConfig, pipeline_depth: int
    ) -> MicroBatchBudget:
        """The engine's budget: one cohort per stage of a `pipeline_depth`-stage pipeline,
        unless `VLLM_PP_MICRO_BATCHES` sets another number (ignored without pipelining)."""
        cohorts = pipeline_depth
        if cohorts > 1:
            cohorts = envs.get_int("VLLM_PP_MICRO_BATCHES") or cohorts
        return cls.from_config(scheduler_config, cohorts)

    def max_batch_seqs(self, num_active_seqs: int) -> int:
        """The sequences one batch may take: ~1/cohorts of the active ones (waiting, running
        or swapped), so the cohorts can be in the pipeline at once instead of one batch
        holding everything; `NO_CAP` with a single cohort."""
        if self.cohorts == 1:
            return NO_CAP
        return max(1, ceil_div(num_active_seqs, self.cohorts))

    def token_budget(self, decode_tokens: int, prefill_tokens: int) -> tuple[int, int]:
        """(one batch's token budget, the most of it decodes may take), given the decode
        tokens (one per decoding sequence) and the prefill tokens waiting to run.

        Every stage runs every micro-batch, so the pipeline moves at the pace of the largest
        one. One round through the pipeline runs every decoding sequence once plus prefill
        chunks up to max_num_batched_tokens; each micro-batch takes ~1/cohorts of the decodes
        and ~1/cohorts of that prefill work (more if fewer decodes are ready), so a long prompt
        is spread over several micro-batches instead of stalling the one that holds it, and
        prefills always progress next to many decodes."""
        budget = self.max_num_batched_tokens
        if self.cohorts == 1:
            return budget, budget
        decode_share = ceil_div(decode_tokens, self.cohorts)
        prefill_share = ceil_div(min(prefill_tokens, budget), self.cohorts)
        return max(1, min(budget, decode_share + prefill_share)), max(1, decode_share)


def over_cap(scheduled: Sized, batch_seqs: int, seq_cap: int) -> bool:
    """Whether a micro-batch of `batch_seqs` sequences passes `seq_cap`
    (`MicroBatchBudget.max_batch_seqs`); its first group always fits (nothing `scheduled`)."""
    return bool(scheduled) and batch_seqs > seq_cap
