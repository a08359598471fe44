"""Full recompute: every unfinished request goes back to the waiting queue and re-prefills
all the tokens it has (prompt + output) through every stage. Work: committed tokens x
pipeline_parallel_size. The plan when the stages keep no boundary caches, and the fallback
when a stage-local rebuild fails part-way. Imports no torch."""

from __future__ import annotations

from vllm.core.scheduler import Scheduler
from vllm.resilience.events import FULL, FULL_AFTER_FAILED_REPLAY, FaultEvent
from vllm.resilience.replay import tokens_in_full


def account(event: FaultEvent, committed_tokens: int, pp: int) -> None:
    """The stages were replaced and every request re-queued before (`requeue_all`): each
    re-prefills every token it had KV for, through every stage."""
    event.stage_recovery = FULL
    event.recomputed_tokens = committed_tokens
    event.recomputed_token_stages = committed_tokens * pp


def fall_back(
    event: FaultEvent, scheduler: Scheduler, committed_at_fault: dict[int, int], pp: int
) -> None:
    """A replay step failed: nothing of the rebuild is trusted; every request is recomputed
    in full with the tokens it has."""
    groups = [*scheduler.running, *scheduler.swapped, *scheduler.waiting]
    tokens = tokens_in_full(groups, committed_at_fault)
    scheduler.requeue_all()
    event.stage_recovery = FULL_AFTER_FAILED_REPLAY
    event.replayed_tokens = 0
    event.recomputed_tokens = tokens
    event.recomputed_token_stages = tokens * pp
