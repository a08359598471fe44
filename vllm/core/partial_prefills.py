"""Concurrent partial prefills, vLLM's `max_num_partial_prefills` / `max_long_partial_prefills`.

With chunked prefill a prompt may be partially prefilled over several steps. With
`max_num_partial_prefills` N > 1 (vLLM V0's `PartialPrefillMetadata`), up to N prompts share
a step's token budget: each prefill chunk takes at most `step budget // k`, where k is the
number of prefills this step can run (the running prefills, plus the waiting prompts that may
join them, at most N). Of those, at most `max_long_partial_prefills` may be *long* (more than
`long_prefill_token_threshold` tokens left to prefill): a waiting long prompt is then passed
over, keeping its place, and the shorter prompts behind it are admitted, so one long prompt
cannot hold back the time to first token of short ones. With N = 1 (the default) none of this
applies: the step's budget is not split and admission stays first come, first served.

`PartialPrefillLimits` are the configured knobs (built once from the `SchedulerConfig`);
`StepPrefills` is one step's count, built by the chunked policy from the queues and updated
as it admits prompts. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm.config import SchedulerConfig


@dataclass(frozen=True)
class PartialPrefillLimits:
    """How many prompts may be partially prefilled at once, and how many of them long."""

    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # Tokens left to prefill above which a prompt counts as long.
    long_prefill_token_threshold: int = 0

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> PartialPrefillLimits:
        return cls(
            config.max_num_partial_prefills,
            config.max_long_partial_prefills,
            config.long_prefill_token_threshold,
        )

    @property
    def enabled(self) -> bool:
        """Whether prompts share a step's budget and long ones may be passed over (N > 1)."""
        return self.max_num_partial_prefills > 1

    def is_long(self, tokens_left: int) -> bool:
        return tokens_left > self.long_prefill_token_threshold

    def for_step(
        self,
        running_left: Iterable[int],
        schedulable_left: Iterable[int],
        waiting_left: Iterable[int],
    ) -> StepPrefills:
        """One step's count from the tokens each prompt has left to prefill:
        `running_left` for every running prefill (in flight or not: a long one in progress
        counts against `max_long_partial_prefills`), `schedulable_left` for those among
        them that may take a chunk this step, `waiting_left` for the waiting prompts in
        queue order (those that may be admitted widen the split, as in vLLM)."""
        if not self.enabled:
            return StepPrefills(self, 1, 0)
        long_running = sum(1 for left in running_left if self.is_long(left))
        prefills = sum(1 for left in schedulable_left if left > 0)
        long_waiting = 0
        for left in waiting_left:
            if prefills >= self.max_num_partial_prefills:
                break
            if self.is_long(left):
                # A long prompt that will be passed over this step takes no share.
                if long_running + long_waiting >= self.max_long_partial_prefills:
                    continue
                long_waiting += 1
            prefills += 1
        return StepPrefills(self, min(prefills, self.max_num_partial_prefills), long_running)


@dataclass
class StepPrefills:
    """The partial prefills of the step being filled: how many share its budget (at least
    one) and how many long ones run or were admitted so far."""

    limits: PartialPrefillLimits
    schedulable: int
    long: int

    def slot(self, step_budget: int) -> int:
        """The most tokens one prefill chunk may take of a step of `step_budget` tokens."""
        return max(1, step_budget // max(1, self.schedulable))

    def may_admit(self, tokens_left: int) -> bool:
        """Whether a waiting prompt with `tokens_left` to prefill may be admitted now (False:
        it is long and enough long prompts are running; it keeps its place in the queue)."""
        limits = self.limits
        return not (
            limits.enabled
            and limits.is_long(tokens_left)
            and self.long >= limits.max_long_partial_prefills
        )

    def admitted(self, tokens_left: int) -> None:
        """Count a prompt just admitted."""
        if self.limits.enabled and self.limits.is_long(tokens_left):
            self.long += 1
