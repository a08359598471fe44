"""What the resilience package may do to the engine: a small typed protocol that `LLMEngine`
implements with public methods. The package never reads the engine's private state; the
engine never lets another module write its queues of outputs or its batches in flight.
Imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn, Protocol

if TYPE_CHECKING:
    from vllm.config import CacheConfig, LoRAConfig, ModelConfig, ParallelConfig
    from vllm.core.scheduler import Scheduler
    from vllm.executor.base import ExecutorBase
    from vllm.lora.registry import LoRARegistry
    from vllm.resilience.errors import StageFailedError
    from vllm.resilience.events import FaultEvent
    from vllm.sequence import SequenceGroup
    from vllm.step_records import BlockOps


class EngineControl(Protocol):
    """The engine as the recovery sees it."""

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def executor(self) -> ExecutorBase: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def cache_config(self) -> CacheConfig: ...

    @property
    def parallel_config(self) -> ParallelConfig: ...

    @property
    def lora_config(self) -> LoRAConfig | None: ...

    @property
    def loras(self) -> LoRARegistry: ...

    def requests_of_call(self, call_id: int | None) -> list[str]:
        """The requests of the step the executor numbered `call_id` (none for None)."""
        ...

    def abandon_in_flight(self) -> list[BlockOps]:
        """A stage failed: the batches in the pipeline will never come back. Forget them
        (their groups stay as the scheduler committed them) and return the block operations
        of steps no rank received, which the rebuild must apply first."""
        ...

    def drain(self) -> None:
        """Collect every batch in the pipeline; their outputs are returned by the next step.
        A stage failing meanwhile is recovered as in a step."""
        ...

    def discard_in_flight(self) -> None:
        """Forget the batches in the pipeline and re-queue their requests for recompute."""
        ...

    def end_as_failed(self, groups: list[SequenceGroup], why: str) -> None:
        """Abort `groups` (their error logged already); `why` is kept for their callers."""
        ...

    def fail(self, error: StageFailedError, why: str) -> NoReturn:
        """Fail-stop: abort every unfinished request, release the workers, raise
        EngineDeadError."""
        ...

    def reconfigure_pipelining(self) -> None:
        """The pipeline changed size: re-decide micro-batches in flight and scheduling ahead
        (nothing is in flight)."""
        ...

    def log_fault(self, event: FaultEvent) -> None:
        """Count a stage failure and its recovery's work in the metrics (if stats are on)."""
        ...
