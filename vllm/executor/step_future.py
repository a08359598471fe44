"""The future of one submitted step (torch-free).

`ExecutorBase.execute_model(request, non_block=True)` returns a `StepFuture` at once, so the
engine keeps several micro-batches inside the pipeline; `result()` waits for the last stage's
sampler output. As in vLLM V1's executors, it is a `concurrent.futures.Future`, but the wait runs
in the thread that asks (the executors read their ranks' connections when asked, not from a
thread of their own), so no thread sits between the engine and the stages.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from vllm.sequence import SamplerOutput


class StepFuture(Future):  # Future[SamplerOutput]; subscripting it at run time needs 3.9+
    """One step in the pipeline.

    `call_id` is the executor's number for the step's calls (None in process): a stage error
    names the call it happened in, and the engine maps it back to the step's requests."""

    def __init__(
        self, call_id: int | None = None, wait: Callable[[], SamplerOutput] | None = None
    ) -> None:
        super().__init__()
        self.call_id = call_id
        self._wait = wait

    @classmethod
    def completed(cls, output: SamplerOutput) -> StepFuture:
        """A step that already ran (the in-process executor)."""
        future = cls()
        future.set_result(output)
        return future

    def result(self, timeout: float | None = None) -> SamplerOutput:
        """The step's sampler output; raises what the step failed with (StageFailedError...).

        `timeout` bounds only a wait that already runs in another thread: the first caller
        waits with the step's own deadline, which the executor set at submission."""
        wait, self._wait = self._wait, None
        if wait is not None:
            try:
                output = wait()
            except Exception as exc:
                self.set_exception(exc)
            except BaseException:
                # An interrupt (SIGINT) in the wait is not the step's outcome: the step is
                # still running and may be waited for again (or discarded).
                self._wait = wait
                raise
            else:
                self.set_result(output)
        result: SamplerOutput = super().result(timeout)
        return result
