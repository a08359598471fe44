"""The errors a failed stage raises, and the one a dead engine raises. Imports nothing of the
package above it: the executors raise these, the engine and the recovery catch them, the
server maps them to HTTP codes (`vllm.entrypoints.health`).

A stage is a replaceable process: it holds weights (reloadable) and the KV cache of its layers
(lost with it). The executor fails a step's wait with StageFailedError as soon as its
supervisor (`vllm.executor.supervisor`) finds a stage process gone, stopped or silent, or a
stage raises; `vllm.resilience.coordinator` then recovers, or gives up with EngineDeadError.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StageFailure:
    """One failed stage: its rank, how it was described, and what was seen."""

    rank: int
    description: str
    problem: str


class StageFailedError(RuntimeError):
    """One or more pipeline stages died, froze or raised while running a step.

    `failures` names each stage (rank, layers, node, pid) and what was seen; `__cause__` is the
    underlying error when there is one (Ray's ActorDiedError, a gloo error, a timeout).
    `detected_after_s`: when the supervisor found it, from the start of the trouble as far
    as it can tell (the last process check that found it well, or the first heartbeat it
    left unanswered: within an interval of the fault); else the failed wait's length."""

    def __init__(
        self,
        failures: list[StageFailure],
        detected_after_s: float,
        call_id: int | None = None,
    ) -> None:
        self.failures = failures
        self.detected_after_s = detected_after_s
        # The engine's call (a step) a stage raised in, when one did: which requests it held.
        self.call_id = call_id
        lines = "; ".join(f"{f.description}: {f.problem}" for f in failures)
        super().__init__(f"pipeline stage failure after {detected_after_s:.1f} s: {lines}")

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    @property
    def raised_signature(self) -> tuple[tuple[int, str], ...] | None:
        """(rank, first line of the error) of each failed stage when every one of them raised
        an exception (not died, froze or missed a deadline): the same signature again after a
        replacement means a failure that replaying the step will only repeat."""
        if not self.failures or not all(f.problem.startswith("raised ") for f in self.failures):
            return None
        return tuple((f.rank, f.problem.splitlines()[0]) for f in self.failures)


class EngineDeadError(RuntimeError):
    """The engine cannot run any more (a stage failed and could not be replaced, or the
    restarts allowed by max_stage_restarts are used up). Every unfinished request was aborted
    and the workers released; build a new LLM / LLMEngine to go on."""
