"""torch's profiler on one rank, started and stopped by the engine (`LLM.start_profile`)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger("vllm.worker")


class StageProfiler:
    """Profiles the steps of one rank; `name` (`stage<p>-rank<r>`) names its files."""

    def __init__(self, device: torch.device, rank: int) -> None:
        self.device = device
        self.rank = rank
        self._running: tuple[Any, str, str] | None = None  # (profiler, trace_dir, name)

    def start(self, trace_dir: str, name: str) -> None:
        """Start profiling on the thread that runs the steps; the trace goes to `trace_dir`
        when `stop` is called.

        On CPU it is torch's legacy autograd profiler, without Kineto: Kineto binds itself to
        the thread that loaded torch and refuses (or crashes on stop) another one, and the
        steps run on another thread in a Ray actor's or an AsyncLLMEngine's process. On CUDA it
        is torch.profiler (Kineto, for the kernels); the Ray actors load torch on their calls
        thread for it (rank_calls.CallsThread)."""
        if self._running is not None:
            raise RuntimeError("Profiler is already running.")
        profiler: Any
        if self.device.type == "cuda":
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            handler = torch.profiler.tensorboard_trace_handler(
                trace_dir, worker_name=name, use_gzip=True
            )
            profiler = torch.profiler.profile(
                activities=activities, record_shapes=True, on_trace_ready=handler
            )
            profiler.start()
        else:
            from torch.autograd import profiler_legacy

            profiler = profiler_legacy.profile(record_shapes=True)
            profiler.__enter__()
        self._running = (profiler, trace_dir, name)
        logger.info("rank %d: profiler started (traces to %s)", self.rank, trace_dir)

    def stop(self) -> str | None:
        """Stop: the trace (Chrome trace format, for https://ui.perfetto.dev:
        `<name>.pt.trace.json`, gzipped by torch on CUDA) and a table of the ops by time
        (`<name>-ops.txt`) are written. Returns the table's path; None when not profiling (a
        rank replaced after a failure)."""
        if self._running is None:
            return None
        (profiler, trace_dir, name), self._running = self._running, None
        if self.device.type == "cuda":
            profiler.stop()  # the handler writes the trace
            sort_by = "self_cuda_time_total"
        else:
            profiler.__exit__(None, None, None)
            os.makedirs(trace_dir, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(trace_dir, f"{name}.pt.trace.json"))
            sort_by = "self_cpu_time_total"
        path = os.path.join(trace_dir, f"{name}-ops.txt")
        with open(path, "w") as f:
            f.write(profiler.key_averages().table(sort_by=sort_by, row_limit=50))
        logger.info("rank %d: profiler stopped; ops by time in %s", self.rank, path)
        return path
