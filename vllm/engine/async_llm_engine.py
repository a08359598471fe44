"""AsyncLLMEngine: the engine behind an asyncio API, for servers and Ray Data.

One background thread owns the LLMEngine and runs its `step()` loop; `step()` blocks on the
oldest micro-batch in the pipeline, so it cannot run on the event loop. Callers never touch the
engine: `generate` queues the request and `abort` queues the id, and the thread applies both
between steps (vLLM V0's `_new_requests` / `_finished_requests`). With pipeline parallelism the
batch queue keeps up to `pipeline_parallel_size` micro-batches in flight while requests arrive
and leave: a request added during a step joins the next micro-batch the engine schedules.

Outputs go back to each request's own event loop with `call_soon_threadsafe`. A caller that
stops iterating (a cancelled task, a closed generator) aborts its request; a request aborted
with `abort()` raises `asyncio.CancelledError` in the iteration still consuming it. If the engine
raises, every pending request fails with AsyncEngineDeadError (the cause chained) and so does
every later call: no wait is left without an end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.engine.request_tracker import RequestTracker
from vllm.inputs import PromptInputs, parse_prompt
from vllm.logger import init_logger
from vllm.outputs import EngineOutput, PoolingRequestOutput, RequestOutput
from vllm.pooling_params import PoolingParams
from vllm.resilience.errors import EngineDeadError
from vllm.resilience.events import EngineHealth
from vllm.sampling_params import SamplingParams

logger = init_logger("vllm.engine.async_llm_engine")

__all__ = ["AsyncEngineDeadError", "AsyncLLMEngine", "AsyncStream", "RequestTracker"]

_FINISHED = object()  # end-of-stream marker


class AsyncEngineDeadError(RuntimeError):
    """The engine's background loop has stopped with an error; the engine cannot serve."""


class AsyncStream:
    """The outputs of one request, passed from the engine thread to the caller's loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    def put(self, item: Any) -> None:
        """Thread-safe: hand an output (or an exception, or the end marker) to the caller."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def finish(self, error: BaseException | None = None) -> None:
        if not self.finished:
            self.finished = True
            self.put(error if error is not None else _FINISHED)

    async def __aiter__(self) -> AsyncGenerator[Any, None]:
        while True:
            item = await self._queue.get()
            if item is _FINISHED:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


# Characters of a request's parameters logged when --max-log-len is not given.
DEFAULT_MAX_LOG_LEN = 1000


def truncate_for_log(text: str, max_len: int | None) -> str:
    """`text` cut to `max_len` characters (DEFAULT_MAX_LOG_LEN if None), saying how much."""
    limit = DEFAULT_MAX_LOG_LEN if max_len is None else max_len
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def _put_all(items: list[tuple[AsyncStream, Any]]) -> None:
    for stream, item in items:
        stream._queue.put_nowait(item)


@dataclass
class _NewRequest:
    stream: AsyncStream
    prompt: Any  # the text, or a prompt dict the engine reads whole (token_type_ids)
    prompt_token_ids: list[int] | None
    params: SamplingParams | PoolingParams
    arrival_time: float
    lora_request: Any = None


class AsyncLLMEngine:
    """An LLMEngine driven by a background thread, with `async generate` (vLLM's API).

    `AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=..., pipeline_parallel_size=2))`;
    then `async for out in engine.generate(prompt, params, request_id): ...` yields
    RequestOutputs (cumulative by default; set `params.output_kind` for deltas or the final
    output only). `abort(request_id)`, `check_health()`, `get_model_config()`."""

    def __init__(
        self,
        engine: LLMEngine,
        log_requests: bool = True,
        start_engine_loop: bool = True,
    ) -> None:
        self.engine = engine
        self.log_requests = log_requests
        # vLLM's --max-log-len: how much of a request's parameters a log line shows (a 10 MB
        # stop list wrote a 10 MB line). None: DEFAULT_MAX_LOG_LEN.
        self.max_log_len: int | None = None
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._new_requests: list[_NewRequest] = []
        self._aborts: list[str] = []
        # Calls to run on the engine thread between steps (profiling), with their futures.
        self._engine_calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._streams: dict[str, AsyncStream] = {}  # owned by the engine thread
        self._active: set[str] = set()  # ids generating (under _lock)
        self._errored_with: BaseException | None = None
        self._hook_tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None
        if start_engine_loop:
            self.start_background_loop()

    # vLLM 0.5's flags: this engine never runs the engine itself in a Ray actor.
    engine_use_ray = False

    @property
    def worker_use_ray(self) -> bool:
        return self.engine.parallel_config.world_size > 1

    @classmethod
    def from_engine_args(
        cls,
        engine_args: AsyncEngineArgs,
        start_engine_loop: bool = True,
        usage_context: Any = None,
        stat_loggers: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncLLMEngine:
        """Build the engine (workers, KV caches) and start its loop (vLLM's signature;
        `stat_loggers` replaces the default loggers, `usage_context` is unused)."""
        engine = LLMEngine.from_engine_args(engine_args, stat_loggers=stat_loggers)
        log_requests = not getattr(engine_args, "disable_log_requests", False)
        built = cls(engine, log_requests=log_requests, start_engine_loop=start_engine_loop)
        built.max_log_len = getattr(engine_args, "max_log_len", None)
        return built

    # -- state ------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.errored

    @property
    def errored(self) -> bool:
        return self._errored_with is not None

    @property
    def dead_error(self) -> AsyncEngineDeadError:
        err = AsyncEngineDeadError(
            "Background loop has errored already: "
            f"{type(self._errored_with).__name__}: {self._errored_with}"
        )
        err.__cause__ = self._errored_with
        return err

    def start_background_loop(self) -> None:
        if self._thread is not None:
            raise RuntimeError("Background loop is already running.")
        self._thread = threading.Thread(target=self._run, name="vllm-engine-loop", daemon=True)
        self._thread.start()

    async def check_health(self) -> None:
        """Raise AsyncEngineDeadError if the background loop has died, StageFailedError if a
        stage is dead or stopped (found between steps too; the next step replaces it)."""
        if self.errored:
            raise self.dead_error
        if self._thread is None or not self._thread.is_alive():
            raise AsyncEngineDeadError("Background loop is not running.")
        # A few /proc reads of this node's rank processes: no need to leave the event loop.
        self.engine.executor.check_health()

    async def health(self) -> EngineHealth:
        """What `/health` reports: healthy, or degraded while a failed stage is being
        replaced (see LLMEngine.health). Raises AsyncEngineDeadError if the background loop
        has died (or the engine is dead), StageFailedError if a failed stage cannot be
        replaced."""
        if self.errored:
            raise self.dead_error
        if self._thread is None or not self._thread.is_alive():
            raise AsyncEngineDeadError("Background loop is not running.")
        try:
            return self.engine.health()
        except EngineDeadError as exc:
            raise AsyncEngineDeadError(str(exc)) from exc

    async def get_model_config(self) -> Any:
        return self.engine.model_config

    async def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    async def get_parallel_config(self) -> Any:
        return self.engine.parallel_config

    async def get_scheduler_config(self) -> Any:
        return self.engine.scheduler_config

    async def get_decoding_config(self) -> Any:
        """vLLM's decoding config: the structured-output backend this engine uses."""
        from types import SimpleNamespace

        return SimpleNamespace(guided_decoding_backend="xgrammar")

    async def get_lora_config(self) -> Any:
        return None  # no LoRA here

    async def is_tracing_enabled(self) -> bool:
        return False

    @property
    def is_stopped(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def add_logger(self, logger_name: str, logger: Any) -> None:
        """See `LLMEngine.add_logger`."""
        self.engine.add_logger(logger_name, logger)

    def remove_logger(self, logger_name: str) -> None:
        self.engine.remove_logger(logger_name)

    async def do_log_stats(self) -> None:
        """Metrics are refreshed by the background loop; kept for vLLM's API."""

    async def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter on every stage (on the engine thread, between steps)."""
        return await self._on_engine_thread(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._on_engine_thread(lambda: self.engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self._on_engine_thread(self.engine.list_loras)

    async def start_profile(self) -> None:
        """Start torch.profiler on every stage (VLLM_TORCH_PROFILER_DIR), between two steps."""
        await self._on_engine_thread(self.engine.start_profile)

    async def stop_profile(self) -> list[str]:
        """Stop profiling; returns the paths of each stage's table of ops by time."""
        return await self._on_engine_thread(self.engine.stop_profile)

    async def reshape_pipeline(self, layer_split: list[int]) -> Any:
        """Re-split the layers over the stages (`LLMEngine.reshape_pipeline`) between two
        steps; streams in flight go on (their requests are recomputed). Returns the event."""
        return await self._on_engine_thread(lambda: self.engine.reshape_pipeline(layer_split))

    async def grow_pipeline(self) -> bool:
        """Start the stages a shrunk pipeline is missing (`LLMEngine.grow_pipeline`) between
        two steps; streams in flight go on. Returns whether it grew."""
        return await self._on_engine_thread(self.engine.grow_pipeline)

    async def get_stage_infos(self) -> list[Any]:
        """Where each rank runs and which layers it holds, read between two steps."""
        return await self._on_engine_thread(self.engine.get_stage_infos)

    async def _on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between two steps (the executor is the engine
        thread's alone), or here when the loop is not running."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return fn()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._errored_with is not None:
                raise self.dead_error
            self._engine_calls.append((fn, future))
        self._wakeup.set()
        return await asyncio.wrap_future(future)

    # -- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptInputs | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: Any = None,
        *,
        inputs: PromptInputs | None = None,
        arrival_time: float | None = None,
        trace_headers: Any = None,
        prompt_adapter_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's RequestOutputs until it finishes.

        `prompt` is a string, `{"prompt": ...}`, `{"prompt_token_ids": [...]}` or a list of
        token ids (`inputs=` is vLLM 0.5's name for it). Bad input raises ValueError/TypeError
        from the first iteration; stopping the iteration early aborts the request."""
        if prompt_adapter_request is not None:
            raise ValueError("prompt_adapter_request: prompt adapters are not supported.")
        if prompt is None:
            prompt = inputs
        if request_id is None:
            raise ValueError("request_id is required.")
        if sampling_params is None:
            sampling_params = SamplingParams()
        request_id = str(request_id)
        stream = self._add_request(request_id, prompt, sampling_params, arrival_time, lora_request)
        done = False
        try:
            async for output in stream:
                done = output.finished
                yield output
            done = True
        finally:
            if not done:
                self._abort(request_id)
                self._run_abort_hook([request_id])

    async def encode(
        self,
        prompt: PromptInputs,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: Any = None,
        *,
        trace_headers: Any = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput[Any], None]:
        """Yield the pooling request's output (vLLM's `encode`): one `PoolingRequestOutput`,
        once its prompt went through every stage. `pooling_params.task` says what to pool
        ("embed", "classify", "score", "encode"; the model's own task when unset). Bad input
        raises ValueError/TypeError from the first iteration; stopping early aborts it."""
        if not isinstance(pooling_params, PoolingParams):
            raise TypeError(
                f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}."
            )
        if priority:
            raise ValueError("priority: priority scheduling is not supported.")
        if tokenization_kwargs:
            raise ValueError("tokenization_kwargs are not supported by this engine.")
        if request_id is None:
            raise ValueError("request_id is required.")
        request_id = str(request_id)
        stream = self._add_request(request_id, prompt, pooling_params, None, lora_request)
        done = False
        try:
            async for output in stream:
                done = output.finished
                yield output
            done = True
        finally:
            if not done:
                self._abort(request_id)
                self._run_abort_hook([request_id])

    async def add_request(
        self,
        request_id: str,
        inputs: PromptInputs,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
        trace_headers: Any = None,
        prompt_adapter_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """vLLM 0.5's lower-level call: the request's output stream (as `generate`; the
        request reaches the engine when the stream is first iterated)."""
        return self.generate(
            inputs,
            params,
            request_id,
            lora_request,
            arrival_time=arrival_time,
            trace_headers=trace_headers,
            prompt_adapter_request=prompt_adapter_request,
        )

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests: a generate() iteration still consuming one raises
        `asyncio.CancelledError` (as vLLM's does)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._engine_abort(ids)

    async def _engine_abort(self, request_ids: Iterable[str]) -> None:
        """vLLM 0.5's hook: awaited on the event loop with the ids of the requests being
        aborted (a subclass may count them and call `super()`). Idempotent: a caller that
        left has already had its request dropped when this runs."""
        for rid in request_ids:
            self._abort(rid)

    def _run_abort_hook(self, request_ids: list[str]) -> None:
        """`_engine_abort` for requests whose caller left (from a closing generator, where
        nothing can be awaited): a task on the running loop, if there is one."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._engine_abort(request_ids))
        self._hook_tasks.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._hook_tasks.discard)

    def _add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None,
        lora_request: Any = None,
    ) -> AsyncStream:
        text: Any
        text, token_ids = parse_prompt(prompt)
        if isinstance(prompt, dict) and "token_type_ids" in prompt:
            # The engine reads the whole prompt (its segment ids with its tokens).
            text, token_ids = prompt, None
        stream = AsyncStream(request_id, asyncio.get_running_loop())
        with self._lock:
            if self._errored_with is not None:
                raise self.dead_error
            if self._stopping:
                raise AsyncEngineDeadError("The engine has been shut down.")
            if request_id in self._active:
                raise ValueError(f"Request {request_id} already exists.")
            self._active.add(request_id)
            self._new_requests.append(
                _NewRequest(
                    stream, text, token_ids, params, arrival_time or time.time(), lora_request
                )
            )
        self._wakeup.set()
        if self.log_requests:
            logger.info(
                "Received request %s: params: %s.",
                request_id,
                truncate_for_log(repr(params), self.max_log_len),
            )
        return stream

    def _abort(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._active or request_id in self._aborts:
                return
            self._aborts.append(request_id)
        self._wakeup.set()
        if self.log_requests:
            logger.info("Aborted request %s.", request_id)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._apply_pending()
                if self._stopping:
                    return
                if not engine.has_unfinished_requests():
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                outputs = engine.step()
                if outputs:
                    self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear about it
            logger.exception("Engine background loop failed")
            self._fail_all(exc)

    def _apply_pending(self) -> None:
        with self._lock:
            new, self._new_requests = self._new_requests, []
            aborts, self._aborts = self._aborts, []
            calls, self._engine_calls = self._engine_calls, []
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as exc:  # the caller's error (e.g. profiling not enabled)
                future.set_exception(exc)
        for req in new:
            rid = req.stream.request_id
            try:
                self.engine.add_request(
                    rid,
                    req.prompt,
                    req.params,
                    prompt_token_ids=req.prompt_token_ids,
                    arrival_time=req.arrival_time,
                    lora_request=req.lora_request,
                )
            except (ValueError, TypeError) as exc:
                # A bad request is refused alone; the engine and the others go on.
                self._forget(rid)
                req.stream.finish(exc)
                continue
            self._streams[rid] = req.stream
        if aborts:
            self.engine.abort_request(aborts)
            for rid in aborts:
                stream = self._streams.pop(rid, None)
                self._forget(rid)
                if stream is not None:
                    # vLLM's contract: a consumer still iterating an aborted request gets
                    # CancelledError, so it cannot mistake the cut output for a whole one.
                    stream.finish(asyncio.CancelledError(f"Request {rid} was aborted."))
            if not self.engine.has_unfinished_requests():
                self.engine.do_log_stats()  # no step will refresh the gauges now

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not one per
        request (a step can finish a token for hundreds of requests)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[AsyncStream, Any]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted meanwhile
                continue
            items = by_loop.setdefault(stream._loop, [])
            error = self.engine.pop_request_error(output.request_id) if output.finished else None
            if error is not None:
                # Failed inside a stage: the caller gets the error, naming the request.
                logger.info("Request %s failed: %s", output.request_id, error.message)
                items.append((stream, error))
            else:
                items.append((stream, output))
            if output.finished:
                del self._streams[output.request_id]
                self._forget(output.request_id)
                stream.finished = True
                if error is None:
                    items.append((stream, _FINISHED))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._active.discard(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._errored_with = exc
            pending = [r.stream for r in self._new_requests]
            self._new_requests = []
            self._active.clear()
            calls, self._engine_calls = self._engine_calls, []
        error = self.dead_error
        for _, future in calls:
            future.set_exception(error)
        for stream in [*self._streams.values(), *pending]:
            stream.finish(error)
        self._streams.clear()

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the loop (pending requests fail with AsyncEngineDeadError) and the workers."""
        with self._lock:
            self._stopping = True
        self._wakeup.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)
        error = AsyncEngineDeadError("The engine has been shut down.")
        with self._lock:
            pending = [r.stream for r in self._new_requests]
            self._new_requests = []
            self._active.clear()
        for stream in [*self._streams.values(), *pending]:
            stream.finish(error)
        self._streams.clear()
        self.engine.shutdown()
