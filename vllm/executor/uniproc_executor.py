"""In-process executor for a single stage (pipeline and tensor parallel size 1)."""

from __future__ import annotations

from typing import Any

from vllm import envs
from vllm.executor.base import ExecutorBase
from vllm.sequence import SamplerOutput
from vllm.step_delta import ExecuteModelRequest
from vllm.worker.worker import Worker


class UniProcExecutor(ExecutorBase):
    """Runs the only worker in the engine's own process; steps complete synchronously."""

    def _init_workers(self) -> None:
        self.worker: Worker = Worker(
            self.model_config,
            self.parallel_config,
            self.scheduler_config,
            self.device_config,
            self.cache_config,
            # Default: torch's own thread count (all cores); the env var pins it.
            num_threads=envs.get_int("VLLM_CPU_THREADS_PER_STAGE") or None,
        )
        self.worker.init_device()
        self.worker.load_model()

    def _run_workers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def execute_model_async(self, request: ExecuteModelRequest, num_tokens: int = 0) -> Any:
        return self.worker.execute_model(request)

    def get_output(self, handle: Any) -> SamplerOutput:
        return handle

    def shutdown(self, graceful: bool = True) -> None:
        if getattr(self, "worker", None) is not None:
            self.worker.shutdown()
            self.worker = None  # type: ignore[assignment]  # shut down: nothing to call
