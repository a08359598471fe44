"""The executor interface: how the engine reaches its stage workers."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Literal, overload

from vllm import envs
from vllm.config import CacheConfig, EngineConfig, ParallelConfig
from vllm.distributed.net_utils import get_file_init_method
from vllm.distributed.pipeline_shape import PipelineShape
from vllm.distributed.rank_verbs import UnknownVerbError, Verb
from vllm.executor.liveness import local_process_problem
from vllm.executor.rank_calls import Calls, RankCalls
from vllm.executor.stage_control import StageControl
from vllm.executor.step_future import StepFuture
from vllm.executor.supervisor import HeartbeatStats, StageSupervisor
from vllm.resilience.errors import StageFailedError, StageFailure
from vllm.sequence import SamplerOutput
from vllm.step_records import ExecuteModelRequest
from vllm.worker.stage_report import StageInfo, StageStats

logger = logging.getLogger("vllm.executor")


class ExecutorBase(ABC):
    """Creates the workers, sizes the KV cache over all stages, and runs steps on them.

    `execute_model(request, non_block=True)` submits one step and returns its `StepFuture` at
    once, so the engine can keep `max_concurrent_batches` batches inside the pipeline; the
    future's `result()` waits for that step's sampler output.

    The executor owns the running pipeline's shape (`shape`, a `PipelineShape`: sizes, layer
    split, block counts, generation) and publishes a new one whenever it changes; the configs
    as they run now (`running_config`, `parallel_config`, `cache_config`) are read through it.
    Executors that can change their stages while serving have a `stage_control`.
    """

    # Each rank's StageInfo, in rank order (set while the workers start).
    stage_infos: list[StageInfo]

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.scheduler_config = engine_config.scheduler_config
        self.device_config = engine_config.device_config
        self._publish(PipelineShape.configured(engine_config))
        self._shut_down = False
        try:
            self._init_workers()
            self._log_stages_and_init_cache()
        except BaseException:
            # A failed start (bad placement, load error) must not leave actors behind.
            self.shutdown()
            raise

    # -- the running pipeline's shape ----------------------------------------------------------

    @property
    def shape(self) -> PipelineShape:
        """The pipeline as it runs now (replaced, never changed, when the pipeline changes)."""
        return self._shape

    @property
    def running_config(self) -> EngineConfig:
        """The engine's configs with the current shape applied (frozen copies)."""
        return self._running_config

    @property
    def parallel_config(self) -> ParallelConfig:
        """The parallel config as the pipeline runs now (its size and split: `shape`)."""
        return self._running_config.parallel_config

    @property
    def cache_config(self) -> CacheConfig:
        """The cache config as the pipeline runs now (its block counts: `shape`)."""
        return self._running_config.cache_config

    def _publish(self, shape: PipelineShape) -> None:
        """`shape` is the pipeline's from now on (the only writer of `shape`)."""
        self._shape = shape
        self._running_config = shape.running_config(self.engine_config)

    @property
    def stage_control(self) -> StageControl | None:
        """What the engine may do to the stages while serving (replace, replay, remove,
        merge, start, join), or None when this executor cannot change its stages."""
        return self if isinstance(self, StageControl) else None

    def require_stage_control(self, action: str) -> StageControl:
        """`stage_control`, or a RuntimeError naming `action` and this executor."""
        control = self.stage_control
        if control is None:
            raise RuntimeError(
                f"{type(self).__name__} cannot {action}: its stages run in the engine's process"
            )
        return control

    @property
    def is_shut_down(self) -> bool:
        """Whether `shutdown` ran (the workers are released; nothing may be called)."""
        return self._shut_down

    def _log_stages_and_init_cache(self) -> None:
        self._refresh_stage_infos()
        self._init_cache()

    def _refresh_stage_infos(self) -> None:
        """Ask every rank where it runs and what it holds; log one line per stage."""
        infos: list[StageInfo] = self._run_workers(Verb.GET_STAGE_INFO)
        # Keep what the executor already knows of each rank (e.g. its Ray node id).
        known: list[StageInfo] = getattr(self, "stage_infos", None) or infos
        for entry, info in zip(known, infos):
            entry.update_from(info)
        self.stage_infos = known
        for info in self.stage_infos:
            start, end = info.layers or (0, 0)
            logger.info(
                "Stage %d: layers [%d, %d) on %s (pid %s, %s, %d threads)",
                info.pp_rank, start, end, info.host, info.pid, info.device, info.threads,
            )  # fmt: skip

    @abstractmethod
    def _init_workers(self) -> None: ...

    @abstractmethod
    def _run_workers(self, method: Verb, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker and return their results in rank order."""

    def collective_rpc(
        self, method: Verb, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Run `method`, one of the ranks' verbs (`vllm.distributed.rank_verbs.Verb`), on
        every rank with `args` and `kwargs`; their results in rank order (vLLM's
        `collective_rpc`, its methods limited to the verbs a rank answers). UnknownVerbError
        for any other name, before anything is sent."""
        if not isinstance(method, Verb):
            try:
                method = Verb(method)
            except ValueError:
                raise UnknownVerbError(method, [verb.value for verb in Verb]) from None
        return self._run_workers(method, *args, **(kwargs or {}))

    def _init_cache(self, per_stage: list[tuple[int, int]] | None = None) -> None:
        """Every stage sizes its cache from its own layers (`per_stage`, asked for when not
        given); the engine uses the minimum."""
        if per_stage is None:
            per_stage = self._run_workers(Verb.DETERMINE_NUM_AVAILABLE_BLOCKS)
        num_gpu = min(b[0] for b in per_stage)
        num_cpu = min(b[1] for b in per_stage)
        logger.info("# GPU blocks: %d, # CPU blocks: %d", num_gpu, num_cpu)
        if len(per_stage) > 1:
            logger.info("Blocks per stage (device, host): %s", per_stage)
        if num_gpu <= 0:
            raise ValueError(
                "No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` (or `kv_cache_space` on CPU) when initializing the "
                "engine."
            )
        max_seq_len = self.cache_config.block_size * num_gpu
        if self.model_config.max_model_len > max_seq_len:
            raise ValueError(
                f"The model's max seq len ({self.model_config.max_model_len}) is larger than "
                f"the maximum number of tokens that can be stored in KV cache ({max_seq_len}). "
                "Try increasing `gpu_memory_utilization` (or `kv_cache_space` on CPU) or "
                "decreasing `max_model_len` when initializing the engine."
            )
        self._publish(self.shape.with_blocks(num_gpu, num_cpu))
        self._run_workers(Verb.INITIALIZE_CACHE, num_gpu, num_cpu)

    def reshape_pipeline(self, layer_split: list[int]) -> None:
        """Re-split the decoder layers over the same stages while serving: every stage takes
        its range under `layer_split` (loading only what it did not hold), its KV cache is
        re-sized from its new layer count and all caches are re-made at the new minimum
        (`shape.num_gpu_blocks`). The pipeline must be empty and the engine must recompute
        every request afterwards. A ValueError (the new minimum holds too few blocks) leaves
        the stages with the new layers but no cache: the caller re-splits back."""
        self._publish(self.shape.resplit(layer_split))
        per_stage = self._run_workers(Verb.RESHAPE, self.shape)
        self._refresh_stage_infos()
        self._init_cache(per_stage)

    def get_stage_stats(self, reset: bool = True) -> list[StageStats]:
        """Per rank: compute / receive / send / idle seconds since the last reset."""
        return self._run_workers(Verb.GET_STAGE_STATS, reset)

    def start_profile(self, trace_dir: str) -> None:
        """Start torch.profiler on every rank; traces go to `trace_dir`."""
        self._run_workers(Verb.START_PROFILE, trace_dir)

    def stop_profile(self) -> list[str]:
        """Stop the profilers; every rank writes its trace. Returns the ops tables' paths."""
        return [path for path in self._run_workers(Verb.STOP_PROFILE) if path]

    def get_stage_memory(self) -> list[dict[str, Any]]:
        """Peak memory per stage, in rank order."""
        return self._run_workers(Verb.GET_MEMORY_STATS)

    @property
    def max_concurrent_batches(self) -> int:
        """Micro-batches that can be inside the pipeline at once: one per stage."""
        return self.shape.pipeline_parallel_size

    # Stages run in processes of their own (Ray actors, mp processes), not in the engine's.
    _stages_in_own_processes = False

    @property
    def stages_in_own_processes(self) -> bool:
        """Whether requests are pickled to reach the stages (so must be picklable)."""
        return self._stages_in_own_processes

    @property
    def supports_async_pipeline(self) -> bool:
        """Whether the last stage can pass sampled ids to a first stage of its own (needed to
        schedule a decode ahead of its output)."""
        return self._stages_in_own_processes and self.shape.pipeline_parallel_size > 1

    @property
    def output_rank(self) -> int:
        """The rank whose step result is the sampler output: the last stage's TP driver."""
        return self.shape.last_stage_driver_rank

    def _requests_per_rank(self, request: ExecuteModelRequest) -> list[ExecuteModelRequest]:
        """What each rank gets for one step: every rank of the first and last stage the step
        message (each TP rank builds its own inputs), middle stages only the block operations
        (they take their batch from the previous stage)."""
        light = replace(request, step=None)
        shape = self.shape
        tp = shape.tensor_parallel_size
        last_stage = shape.pipeline_parallel_size - 1
        world = shape.world_size
        return [request if rank // tp in (0, last_stage) else light for rank in range(world)]

    @abstractmethod
    def _submit_step(self, request: ExecuteModelRequest, num_tokens: int) -> StepFuture:
        """Send one step to the pipeline without waiting. `num_tokens` (the step's batched
        tokens) sizes its deadline. Raises MessageNotSerializableError before anything is
        sent when the step cannot be pickled for the stages."""

    @overload
    def execute_model(
        self, request: ExecuteModelRequest, non_block: Literal[False] = False, num_tokens: int = 0
    ) -> SamplerOutput: ...

    @overload
    def execute_model(
        self, request: ExecuteModelRequest, non_block: Literal[True], num_tokens: int = 0
    ) -> StepFuture: ...

    def execute_model(
        self, request: ExecuteModelRequest, non_block: bool = False, num_tokens: int = 0
    ) -> SamplerOutput | StepFuture:
        """Run one step: its sampler output, or with `non_block` its future at once.

        The future's `result()` raises StageFailedError (naming the stages) when a stage dies,
        freezes or raises, or the step misses its deadline."""
        future = self._submit_step(request, num_tokens)
        return future if non_block else future.result()

    def check_health(self) -> None:  # noqa: B027  (optional hook: nothing to check in-process)
        """Raise StageFailedError when a stage is known to be unable to run a step (its
        process dead or stopped, its heartbeat silent), between steps as well as during
        them."""

    def heartbeat_stats(self) -> list[HeartbeatStats]:
        """Each rank's heartbeat round trips while serving (none in-process)."""
        return []

    def discard_steps(self) -> None:  # noqa: B027  (optional hook: nothing to do in-process)
        """Forget the outputs of every submitted step (the engine will not collect them)."""

    def shutdown(self, graceful: bool = True) -> None:
        """Release the workers; `graceful=False` kills them without waiting on them. Safe to
        call again (nothing is done)."""
        if self._shut_down:
            return
        self._shut_down = True
        self._release_workers(graceful)

    @abstractmethod
    def _release_workers(self, graceful: bool) -> None:
        """The backend's part of `shutdown` (runs once)."""


class StageProcessExecutor(ExecutorBase):
    """An executor whose ranks run in processes of their own (Ray actors, mp processes) and
    are reached through one connection each (`self.calls`, `vllm.executor.rank_calls`).

    A step goes to every rank without waiting; `get_output` waits for the last stage's
    output and fails as soon as any rank reports an error or is lost, or the supervisor
    (`self.watch`, `vllm.executor.supervisor`: heartbeats and this node's processes, on a
    thread of its own) finds one stopped, gone or silent. Subclasses start the processes,
    attach their connections (calls and heartbeat), say how a failure is named
    (`_failures_named`) and how long a set-up call may take (`_call_timeout_s`)."""

    _stages_in_own_processes = True
    calls: RankCalls
    watch: StageSupervisor
    # The private directory of the FileStore rendezvous (ranks on one node), made on first use.
    _rendezvous_dir: str | None = None
    _rendezvous_count = 0

    @abstractmethod
    def _failures_named(self, timeout_problem: str) -> AbstractContextManager[None]:
        """Turns a rank's error, loss or missed deadline (`timeout_problem`) raised inside it
        into a StageFailedError naming the stage."""

    def _spares_wanted(self) -> int:
        """How many warm spares to keep: VLLM_PP_SPARE_PROCESSES, none when stages are never
        replaced; ValueError naming the variable when it is negative."""
        if self.parallel_config.max_stage_restarts == 0:
            return 0
        wanted = envs.get_int("VLLM_PP_SPARE_PROCESSES")
        if wanted < 0:
            raise ValueError(f"VLLM_PP_SPARE_PROCESSES must be >= 0, got {wanted}.")
        return wanted

    @abstractmethod
    def _call_timeout_s(self) -> float:
        """How long a set-up or stats call may take (0: no limit)."""

    def _start_calls(self, world_size: int) -> None:
        """The calls to the ranks, and the watch that marks a failed rank suspect in them."""
        self.calls = RankCalls(world_size)
        self.watch = StageSupervisor(world_size, self.calls.set_suspect)

    def heartbeat_stats(self) -> list[HeartbeatStats]:
        """Each rank's heartbeat round trips while the timeout applied (p50, p99, max)."""
        return self.watch.stats()

    def _log_stages_and_init_cache(self) -> None:
        super()._log_stages_and_init_cache()
        # Set-up is over (torch imported, workers built): heartbeat silences count from now.
        self.watch.arm()

    @contextlib.contextmanager
    def _heartbeat_timeout_lifted(self) -> Iterator[None]:
        """For calls that may hold a rank's GIL for long outside any step (the profiler
        starting, or writing its trace): no heartbeat timeout meanwhile. Dead or stopped
        processes are still found at once."""
        self.watch.arm(armed=False)
        try:
            yield
        finally:
            self.watch.arm()

    def start_profile(self, trace_dir: str) -> None:
        with self._heartbeat_timeout_lifted():
            super().start_profile(trace_dir)

    def stop_profile(self) -> list[str]:
        with self._heartbeat_timeout_lifted():
            return super().stop_profile()

    def reshape_pipeline(self, layer_split: list[int]) -> None:
        # Loading layers is set-up: it may hold a rank's GIL for a while outside any step.
        with self._heartbeat_timeout_lifted():
            super().reshape_pipeline(layer_split)

    def _close_calls(self) -> None:
        """Stop watching (first: the ranks are about to go) and close the connections."""
        watch: StageSupervisor | None = getattr(self, "watch", None)
        if watch is not None:
            watch.close()
        calls: RankCalls | None = getattr(self, "calls", None)
        if calls is not None:
            calls.close()

    def _local_init_method(self) -> str:
        """A rendezvous for ranks that all run on this node: a new FileStore file in a
        private directory of the engine's (mode 0700), so the ranks' store listens on no port
        at all. Each (re-)formation of the groups gets a file of its own."""
        if self._rendezvous_dir is None:
            self._rendezvous_dir = tempfile.mkdtemp(prefix="vllm-rendezvous-")
        self._rendezvous_count += 1
        return get_file_init_method(self._rendezvous_dir, f"store-{self._rendezvous_count}")

    def _remove_rendezvous_dir(self) -> None:
        directory = self._rendezvous_dir
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
            self._rendezvous_dir = None

    def _load_replacements(self, ranks: list[int], budget: float) -> None:
        """New ranks that joined the groups: load their layers, give them caches of the
        engine's size and record (and log) where they run."""
        num_gpu, num_cpu = self.shape.num_gpu_blocks, self.shape.num_cpu_blocks
        self._call_ranks(ranks, Verb.LOAD_MODEL, timeout=budget)
        self._call_ranks(ranks, Verb.INITIALIZE_CACHE, num_gpu, num_cpu, timeout=budget)
        infos = self._call_ranks(ranks, Verb.GET_STAGE_INFO, timeout=budget)
        for rank, info in zip(ranks, infos):
            self.stage_infos[rank].update_from(info)
            logger.info("Replaced %s", self.stage_infos[rank].describe())
        self.watch.arm()  # the replacement is over (see replace_stages)

    def check_health(self) -> None:
        """Every rank process on this node read now, and what the supervisor found (a
        silent heartbeat, anywhere): a failed rank fails the check at once, naming its stage
        (`/health` reports it even while the engine is idle)."""
        problems = self.watch.problems()
        for rank, info in enumerate(self.stage_infos):
            problem = local_process_problem(info.pid, info.host) or problems.get(rank)
            if problem is not None:
                name = f"{info.describe()} tp_rank {info.tp_rank}"
                raise StageFailedError([StageFailure(rank, name, problem)], 0.0)

    def _submit(self, calls: Calls) -> int:
        with self._failures_named("could not take a call"):
            return self.calls.submit(calls)

    def _wait_calls(
        self, ranks: list[int], call_id: int, timeout: float | None = None
    ) -> list[Any]:
        if timeout is None:
            timeout = self._call_timeout_s()
        with self._failures_named(f"did not finish a call within {timeout:g} s"):
            return self.calls.wait_all(ranks, call_id, timeout)

    def _call_ranks(
        self, ranks: list[int], method: Verb, *args: Any, timeout: float | None = None
    ) -> list[Any]:
        """Call `method` on the workers of `ranks` and return their results in that order."""
        call_id = self._submit({r: (method, args, {}) for r in ranks})
        return self._wait_calls(ranks, call_id, timeout)

    def _run_workers(self, method: Verb, *args: Any, **kwargs: Any) -> list[Any]:
        ranks = list(range(self.shape.world_size))
        return self._wait_calls(ranks, self._submit({r: (method, args, kwargs) for r in ranks}))

    def _run_workers_within(self, method: Verb, timeout_s: float, *args: Any) -> list[Any]:
        ranks = list(range(self.shape.world_size))
        call_id = self._submit({r: (method, args, {}) for r in ranks})
        return self._wait_calls(ranks, call_id, timeout_s)

    def _submit_step(self, request: ExecuteModelRequest, num_tokens: int) -> StepFuture:
        requests = self._requests_per_rank(request)
        call_id = self._submit(
            {rank: (Verb.EXECUTE_MODEL, (req,), {}) for rank, req in enumerate(requests)}
        )
        deadline_s = self.parallel_config.step_deadline_s(num_tokens)
        return StepFuture(call_id, lambda: self._wait_step(call_id, deadline_s))

    def _wait_step(self, call_id: int, deadline_s: float) -> SamplerOutput:
        # Any rank's error or loss fails this wait: a failed earlier stage would otherwise
        # leave the last one waiting forever.
        with self._failures_named(f"missed the {deadline_s:.0f} s step deadline"):
            output = self.calls.wait_for(self.output_rank, call_id, deadline_s)
        # The other ranks' part of this step, and outputs of discarded earlier steps (an
        # error among them was raised above).
        self.calls.drop_through(call_id)
        return output

    # discard_steps: nothing to do. The outputs of steps nobody collects are dropped when a
    # later step is collected; an error in them still fails the next wait.
