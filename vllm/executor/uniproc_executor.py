"""In-process executor for a single stage (pipeline and tensor parallel size 1)."""

from __future__ import annotations

from typing import Any

from vllm import envs
from vllm.distributed.rank_verbs import Verb
from vllm.executor.base import ExecutorBase
from vllm.executor.step_future import StepFuture
from vllm.step_records import ExecuteModelRequest
from vllm.worker.worker import Worker, worker_verbs


class UniProcExecutor(ExecutorBase):
    """Runs the only worker in the engine's own process; steps complete synchronously."""

    def _init_workers(self) -> None:
        self.worker: Worker = Worker(
            self.engine_config,
            # Default: torch's own thread count (all cores); the env var pins it.
            num_threads=envs.get_int("VLLM_CPU_THREADS_PER_STAGE") or None,
        )
        # The same table of verbs as a rank in a process of its own answers.
        self.handlers = worker_verbs(self.worker)
        self.worker.init_device()
        self.worker.load_model()

    def _run_workers(self, method: Verb, *args: Any, **kwargs: Any) -> list[Any]:
        # In process: no connection to guard, and no argument to check (the engine's own).
        return [self.handlers[method](*args, **kwargs)]

    def _submit_step(self, request: ExecuteModelRequest, num_tokens: int) -> StepFuture:
        # The only stage runs here and now: the future is complete when it is returned.
        output = self.worker.execute_model(request)
        assert output is not None  # the only stage is the last one: it samples
        return StepFuture.completed(output)

    def _release_workers(self, graceful: bool) -> None:
        if getattr(self, "worker", None) is not None:
            self.worker.shutdown()
            # Nothing may keep the Worker (its weights, its cache) alive in the user's process.
            self.handlers = {}
            self.worker = None  # type: ignore[assignment]  # shut down: nothing to call
