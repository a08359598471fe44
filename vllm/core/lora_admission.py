"""`LoRAAdmission`: the scheduler never runs more distinct LoRA adapters than the stages have
slots (`max_loras`). Imports no torch.

The rule is kept on the running set, as vLLM V0 does: a waiting or swapped group whose adapter
is not among the running groups' comes in only while fewer than `max_loras` adapters run.
Every step (of either policy, at any pipeline depth, scheduled ahead or not) is a subset of
the running groups, so no step ever needs more adapters than there are slots, and a stage
never evicts an adapter a batch in flight still uses.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.sequence import SequenceGroup


class LoRAAdmission:
    """Consulted by the scheduler before it admits or swaps in a group."""

    def __init__(self, max_loras: int | None) -> None:
        if max_loras is not None and max_loras < 1:
            raise ValueError(f"max_loras ({max_loras}) must be >= 1.")
        self.max_loras = max_loras

    def allows(self, seq_group: SequenceGroup, running: Iterable[SequenceGroup]) -> bool:
        """Whether `seq_group` may join `running` without exceeding `max_loras` adapters."""
        lora_id = seq_group.lora_int_id
        if lora_id == 0 or self.max_loras is None:
            return True
        active = {g.lora_int_id for g in running if g.lora_int_id and not g.is_finished()}
        return lora_id in active or len(active) < self.max_loras
