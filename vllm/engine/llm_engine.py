"""LLMEngine: requests in, RequestOutputs out. add_request / step / abort_request.

Each `step` keeps the pipeline full: it schedules and submits batches until the batch queue
holds `max_concurrent_batches` (the pipeline depth, twice that with async scheduling, where a
decode micro-batch's next step is scheduled before its output comes back) or nothing more can
be scheduled, then collects the oldest batch and processes its tokens.

Failures: an exception escaping `step` (a KeyboardInterrupt included) re-queues what was in
flight for recompute, so the engine stays usable. A request whose own sampling work raised in
the last stage (its logits processor...) comes back marked failed: it ends as aborted, with a
RequestFailedError kept for its caller (`pop_request_error`), and the stage and the other
requests go on. A failed stage (StageFailedError) is replaced and its KV rebuilt, by the
replaced stages alone or by recomputing every request, up to `max_stage_restarts`
replacements within VLLM_STAGE_RESTART_WINDOW_S (a rate, so a long-lived server is not worn
out by rare faults); past that the engine aborts everything, releases its workers and raises
EngineDeadError. A stage that cannot be replaced leaves the pipeline (PP N -> N-1) and is
started again later. All of that is `vllm.resilience` (start at its coordinator), which
reaches the engine through the public methods of `EngineControl` only.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from typing import Any, Iterable, NoReturn

from vllm import envs
from vllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from vllm.core.budget import MicroBatchBudget
from vllm.core.chunk_sizer import ChunkSizer, prior_pair_cost
from vllm.core.scheduler import Scheduler, SchedulerOutputs
from vllm.distributed.serialization import MessageNotSerializableError
from vllm.engine.batch_queue import BatchQueue
from vllm.engine.interrupts import sigint_deferred
from vllm.engine.output_processor import OutputProcessor
from vllm.engine.request_validation import check_sendable, validate_request
from vllm.executor.base import ExecutorBase
from vllm.logger import init_logger
from vllm.lora.registry import LoRARegistry
from vllm.lora.request import LoRARequest
from vllm.outputs import EngineOutput, output_of_group
from vllm.pooling_params import PoolingParams
from vllm.request_failure import RequestFailedError
from vllm.resilience.coordinator import RecoveryCoordinator
from vllm.resilience.errors import EngineDeadError, StageFailedError
from vllm.resilience.events import EngineHealth, FaultEvent, ReshapeEvent
from vllm.sampling_params import SamplingParams
from vllm.sequence import Sequence, SequenceGroup
from vllm.spec_decode.draft_model import DraftModelProposer, draft_engine_kwargs
from vllm.spec_decode.planner import DraftPlanner, step_outcome
from vllm.step_records import BlockOps, RequestRecord
from vllm.worker.stage_report import StageInfo, StageStats

logger = init_logger("vllm.engine.llm_engine")

# Errors of failed requests kept for pop_request_error (the oldest are dropped past this).
_MAX_KEPT_REQUEST_ERRORS = 1024


class LLMEngine:
    """The offline engine: a scheduler, an executor with one worker per stage, a tokenizer."""

    def __init__(
        self,
        engine_config: EngineConfig,
        log_stats: bool = False,
        served_model_name: str | None = None,
        stat_loggers: dict[str, Any] | None = None,
    ) -> None:
        self.engine_config = engine_config
        model_config = self.model_config = engine_config.model_config
        cache_config = engine_config.cache_config
        parallel_config = engine_config.parallel_config
        scheduler_config = self.scheduler_config = engine_config.scheduler_config
        device_config = self.device_config = engine_config.device_config
        sizes = model_config.get_pp_layer_sizes(parallel_config)
        logger.info(
            "Initializing an LLM engine with config: model=%r, dtype=%s, max_seq_len=%d, "
            "pipeline_parallel_size=%d (layers per stage %s), device=%s, block_size=%d",
            model_config.model,
            model_config.dtype,
            model_config.max_model_len,
            parallel_config.pipeline_parallel_size,
            sizes,
            device_config.device,
            cache_config.block_size,
        )
        self.tokenizer = None if model_config.skip_tokenizer_init else _load_tokenizer(model_config)
        self.generation_config = _load_generation_config(model_config)
        self.eos_token_id = _eos_token_id(self.tokenizer, model_config)
        # Owns the running pipeline's shape (`parallel_config` and `cache_config` below).
        self.executor: ExecutorBase = _make_executor(engine_config)
        # The micro-batches (decode cohorts) in the pipeline, decided here (and again when the
        # pipeline changes size): one per stage unless VLLM_PP_MICRO_BATCHES says otherwise.
        budget, async_pipeline = _pipelining(scheduler_config, self.executor)
        self.lora_config = engine_config.lora_config
        # The adapters every rank holds (LoRA enabled: the stages' LoRA layers are installed).
        self.loras = LoRARegistry(self.lora_config, self.executor)
        self.scheduler = Scheduler(
            scheduler_config,
            self.cache_config,  # with the block counts the stages hold
            budget,
            schedule_ahead=async_pipeline,
            max_loras=self.lora_config.max_loras if self.lora_config else None,
            pipeline_chunks=envs.get_bool("VLLM_PP_CHUNKED_PIPELINING"),
            draft_planner=_draft_planner(engine_config),
            chunk_sizer=_chunk_sizer(engine_config),
        )
        self.batch_queue = BatchQueue(self.executor, budget.cohorts, async_pipeline)
        self.output_processor = OutputProcessor(
            self.scheduler, self.tokenizer, scheduler_config.max_model_len, self._new_seq_id
        )
        self.seq_counter = itertools.count()
        if async_pipeline:
            logger.info(
                "Async scheduling: decodes are scheduled ahead of their outputs (up to %d "
                "micro-batches in flight)",
                self.batch_queue.max_concurrent_batches,
            )
        self._finished_request_ids: list[str] = []
        # Structured outputs: grammars compiled at add_request (built on first use).
        self._grammar_cache: Any = None
        # Outputs made while scheduling (ignored prompts), returned by this or the next step
        # even if the step fails after making them.
        self._pending_outputs: list[EngineOutput] = []
        self.num_steps = 0
        # Requests that failed inside a stage (or could not be sent): their errors, until the
        # caller takes them.
        self._request_errors: dict[str, RequestFailedError] = {}
        self._dead: EngineDeadError | None = None
        # Stage failures (their events, the restart budget, how each is recovered) and every
        # change of the pipeline: built once the scheduler and batch queue exist.
        self.resilience = RecoveryCoordinator(self)
        self._profiling = False
        self.log_stats = log_stats
        # Metrics are labelled with the name clients use (the server's --served-model-name).
        self.served_model_name = served_model_name or model_config.model
        # vLLM's stat loggers by name ("logging", "prometheus"; `stat_loggers` replaces
        # them); `add_logger` / `remove_logger` change the dict the collector reads.
        self._stat_loggers: dict[str, Any] = {}
        self.stats: Any = None
        if log_stats:
            from vllm.engine.metrics import default_stat_loggers

            if isinstance(stat_loggers, dict):  # vLLM 0.5: {name: StatLoggerBase}
                self._stat_loggers.update(stat_loggers)
            else:
                if stat_loggers is not None:  # vLLM V1's list of logger factories
                    logger.warning(
                        "stat_loggers as a list of factories (vLLM V1) is not supported; "
                        "using the default loggers."
                    )
                self._stat_loggers.update(default_stat_loggers(self.served_model_name))
            self.stats = _make_stats_collector(self.scheduler, self._stat_loggers)
            for stat_logger in self._stat_loggers.values():
                stat_logger.info("cache_config", self.cache_config)

    @classmethod
    def from_engine_args(
        cls, engine_args: Any, usage_context: Any = None, stat_loggers: Any = None
    ) -> LLMEngine:
        """vLLM's signature (`usage_context` is accepted and unused)."""
        return cls(
            engine_args.create_engine_config(),
            stat_loggers=stat_loggers,
            log_stats=not getattr(engine_args, "disable_log_stats", True),
            # As vLLM: the name the user gave (`smollm2`, not the resolved GGUF path).
            served_model_name=_first_name(getattr(engine_args, "served_model_name", None))
            or engine_args.model,
        )

    @property
    def parallel_config(self) -> ParallelConfig:
        """The parallel config as the pipeline runs now: the configured one with the size and
        layer split of the executor's `PipelineShape` (a stage that could not be replaced
        leaves; the layers may be re-split). Frozen: the configured values are
        `engine_config.parallel_config`."""
        return self.executor.running_config.parallel_config

    @property
    def cache_config(self) -> CacheConfig:
        """The cache config with the block counts every stage holds now (the executor's
        `PipelineShape`). Frozen."""
        return self.executor.running_config.cache_config

    @property
    def stat_loggers(self) -> dict[str, Any]:
        """The stat loggers by name. As in vLLM, an engine with stats off has none: reading
        this raises AttributeError (until `add_logger` turns collection on)."""
        if self.stats is None:
            raise AttributeError("stat_loggers: stats are off (disable_log_stats=True).")
        return self._stat_loggers

    def add_logger(self, logger_name: str, logger: Any) -> None:
        """Feed `logger` (a `vllm.engine.metrics.StatLoggerBase`) every step's Stats; stats
        are collected from now on even if the engine was built with them off."""
        if logger_name in self._stat_loggers:
            raise KeyError(f"Logger with name {logger_name} already exists.")
        self._stat_loggers[logger_name] = logger
        if self.stats is None:
            self.stats = _make_stats_collector(self.scheduler, self._stat_loggers)

    def remove_logger(self, logger_name: str) -> None:
        """Stop feeding the logger added under `logger_name`."""
        if logger_name not in self._stat_loggers:
            raise KeyError(f"Logger with name {logger_name} does not exist.")
        del self._stat_loggers[logger_name]

    def do_log_stats(self) -> None:
        """Refresh the metrics (queue sizes, cache usage) outside a step."""
        if self.stats is not None:
            self.stats.refresh()

    def _new_seq_id(self) -> int:
        return next(self.seq_counter)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: Any = None,
        sampling_params: SamplingParams | PoolingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        *,
        inputs: Any = None,
        params: SamplingParams | PoolingParams | None = None,
        trace_headers: Any = None,
        prompt_adapter_request: Any = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; bad input raises ValueError/TypeError and leaves the engine as is.

        Takes vLLM 0.5's form too: `add_request(request_id, inputs, params, arrival_time)`
        with `inputs` a string, a `TextPrompt` / `TokensPrompt` dict or token ids.
        `lora_request`: the adapter to run it with (registered on first use)."""
        self._check_alive()
        self.loras.check_request(lora_request)
        if prompt is None and inputs is not None:
            prompt = inputs
        if sampling_params is None:
            sampling_params = params
        pooling_params: PoolingParams | None = None
        if isinstance(sampling_params, PoolingParams):
            pooling_params = self._verify_pooling_params(sampling_params)
            sampling_params = _pooling_placeholder(pooling_params, self.model_config)
        elif self.model_config.is_pooling_model and isinstance(sampling_params, SamplingParams):
            raise ValueError(
                "LLM.generate() is only supported for generative models. Try passing "
                "`--runner generate` to use the model as a generative model."
            )
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                "sampling_params must be a SamplingParams (or a PoolingParams for a pooling "
                f"model), got {type(sampling_params).__name__}."
            )
        if isinstance(prompt_token_ids, (int, float)) and not isinstance(prompt_token_ids, bool):
            # vLLM 0.5's positional order: (request_id, inputs, params, arrival_time).
            prompt_token_ids, arrival_time = None, float(prompt_token_ids)
        token_type_ids = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if not isinstance(prompt, str) and prompt is not None and prompt_token_ids is None:
            from vllm.inputs import parse_prompt

            prompt, prompt_token_ids = parse_prompt(prompt)
        if prompt_adapter_request is not None:
            raise ValueError("prompt_adapter_request: prompt adapters are not supported.")
        prompt_token_ids = validate_request(
            request_id,
            prompt,
            sampling_params,
            prompt_token_ids,
            self.tokenizer,
            self.model_config,
        )
        if token_type_ids is not None:
            token_type_ids = _check_token_type_ids(token_type_ids, pooling_params, prompt_token_ids)
        if pooling_params is not None and len(prompt_token_ids) > self.model_config.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum "
                f"model length of {self.model_config.max_model_len}. Make sure that "
                "`max_model_len` is no smaller than the number of text tokens."
            )
        if sampling_params.structured_outputs is not None:
            self.check_structured_outputs(sampling_params)
        eos = self.eos_token_id
        if sampling_params.best_of > self.scheduler_config.max_num_seqs:
            raise ValueError(
                f"best_of ({sampling_params.best_of}) must not exceed max_num_seqs "
                f"({self.scheduler_config.max_num_seqs}): the request could never be scheduled."
            )
        if self.executor.stages_in_own_processes:
            check_sendable(sampling_params)
        if lora_request is not None:
            self.loras.ensure(lora_request)
        params = sampling_params.clone()
        # Extra EOS ids of the model's generation_config stop generation too (vLLM does this).
        params.update_from_generation_config(self.generation_config, eos)
        seq = Sequence(
            self._new_seq_id(),
            prompt,
            prompt_token_ids,
            self.cache_config.block_size,
            eos,
            token_type_ids=token_type_ids,
        )
        group = SequenceGroup(
            str(request_id),
            [seq],
            params,
            arrival_time if arrival_time is not None else time.time(),
            lora_request=lora_request,
            pooling_params=pooling_params,
        )
        self.scheduler.add_seq_group(group)

    def _verify_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """The engine's copy of a pooling request's parameters, verified for this model:
        its task (the model's default when unset) must be one the model runs."""
        config = self.model_config
        if not config.is_pooling_model:
            raise ValueError(
                "LLM.encode() is only supported for pooling models. Try passing "
                "`--runner pooling` to use the model as a pooling model."
            )
        params = params.clone()
        supported = config.supported_tasks
        task = params.task or _default_task(config.convert_type)
        if task not in supported:
            raise ValueError(f"pooling_task must be one of {supported}, got {task!r}.")
        params.verify(task, config)
        pooling_type = getattr(config.pooler_config, "pooling_type", None) or "LAST"
        # Only an embedder's LAST pooling may skip a cached prefix: the other types read every
        # prompt position, and a classifier's last non-padding token may lie inside it.
        params.skip_reading_prefix_cache = pooling_type != "LAST" or config.convert_type != "embed"
        return params

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every stage (False if its id is registered already)."""
        self._check_alive()
        return self.loras.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter (False if unknown or still used by an unfinished request)."""
        self._check_alive()
        queues = (self.scheduler.waiting, self.scheduler.running, self.scheduler.swapped)
        if any(g.lora_int_id == lora_id for queue in queues for g in queue):
            logger.warning("LoRA adapter %d is used by unfinished requests: not removed", lora_id)
            return False
        return self.loras.remove(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the registered adapters."""
        return self.loras.ids()

    def check_structured_outputs(self, sampling_params: SamplingParams) -> None:
        """Compile the request's grammar now (cached per spec): a schema, regex or grammar
        the backend refuses is a ValueError here, before the request is queued."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the tokenizer (skip_tokenizer_init=True)")
        if self._grammar_cache is None:
            from vllm.structured_output.compiler import compile_cache_for

            self._grammar_cache = compile_cache_for(self.model_config, self.tokenizer)
        from vllm.structured_output.params import grammar_spec

        assert sampling_params.structured_outputs is not None
        self._grammar_cache.compile(grammar_spec(sampling_params.structured_outputs))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests; one still inside the pipeline has its result discarded on return."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with sigint_deferred():
            self.scheduler.abort_seq_group(ids)
        self._finished_request_ids.extend(ids)

    def pop_request_error(self, request_id: str) -> RequestFailedError | None:
        """Why a request that finished as aborted failed, if the engine failed it (once)."""
        return self._request_errors.pop(request_id, None)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_seqs()
            or bool(self.batch_queue)
            or bool(self._pending_outputs)
        )

    @property
    def is_dead(self) -> bool:
        """True once a stage failure could not be recovered (see EngineDeadError)."""
        return self._dead is not None

    def start_profile(self) -> None:
        """Start torch.profiler on every stage (vLLM's profiling: VLLM_TORCH_PROFILER_DIR)."""
        self._check_alive()
        trace_dir = envs.get_str("VLLM_TORCH_PROFILER_DIR")
        if not trace_dir:
            raise RuntimeError("Profiler is not enabled.")
        if self._profiling:
            raise RuntimeError("Profiler is already running.")
        trace_dir = os.path.abspath(trace_dir)
        os.makedirs(trace_dir, exist_ok=True)
        self.executor.start_profile(trace_dir)
        self._profiling = True
        logger.info("Profiling every stage; traces go to %s", trace_dir)

    def stop_profile(self) -> list[str]:
        """Stop the profilers; each stage writes its trace and a table of its ops by time.
        Returns the tables' paths."""
        if not self._profiling:
            raise RuntimeError("Profiler is not running.")
        self._profiling = False
        self._check_alive()
        return self.executor.stop_profile()

    def check_health(self) -> None:
        """Raise if the engine is dead (EngineDeadError) or a stage cannot run a step now
        (StageFailedError, naming it: the next step replaces it)."""
        self._check_alive()
        self.executor.check_health()

    def health(self) -> EngineHealth:
        """What `/health` reports of this engine: healthy, or degraded while failed stages are
        being replaced -- or found failed (a process stopped or gone, a heartbeat silent)
        with a replacement still allowed, which the next step makes -- or while the pipeline
        runs with fewer stages than configured (`vllm.resilience.plans.shrink`). Raises
        EngineDeadError when the engine is dead, StageFailedError when a failed stage cannot
        be replaced.
        Safe to call from another thread while the engine steps."""
        self._check_alive()
        return self.resilience.health()

    def get_stage_infos(self) -> list[StageInfo]:
        """Where each rank runs and what it holds (stage, layers, node, pid, threads,
        parameters), in rank order."""
        self._check_alive()
        return [dataclasses.replace(info) for info in self.executor.stage_infos]

    def reshape_pipeline(self, layer_split: list[int]) -> ReshapeEvent:
        """Re-split the decoder layers over the stages while serving: `layer_split` gives the
        layers of each stage (one positive integer per stage, summing to the model's layers;
        else ValueError naming it). The pipeline is drained, every stage loads the layers of
        its new range and re-sizes its KV cache, and every unfinished request is recomputed
        with the tokens it has (nothing is lost; outputs are unchanged). Returns what was done
        (see `vllm.resilience.plans.reshape`)."""
        self._check_alive()
        return self.resilience.reshape(layer_split)

    def grow_pipeline(self) -> bool:
        """While a stage that could not be replaced is missing (the pipeline shrank), start
        it again now and re-form the pipeline at its configured size and split; returns
        whether it grew (False: nothing missing, or the stage could not be started -- the
        log says why). Every unfinished request is recomputed with the tokens it has."""
        self._check_alive()
        return self.resilience.grow()

    # -- EngineControl: what the recovery (`vllm.resilience`) may do to the engine --------------

    def reconfigure_pipelining(self) -> None:
        """The micro-batches kept in flight and scheduling ahead, for the pipeline's size now
        (after it shrank or grew back; nothing is in flight)."""
        budget, async_pipeline = _pipelining(self.scheduler_config, self.executor)
        self.scheduler.configure_pipelining(budget, async_pipeline)
        self.batch_queue.configure(budget.cohorts, async_pipeline)

    def get_stage_stats(self, reset: bool = True) -> list[StageStats]:
        """Where each rank's time went since the last reset (compute, receive, send, idle,
        cache operations), in rank order."""
        self._check_alive()
        return self.executor.get_stage_stats(reset)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead)) from self._dead.__cause__

    def _submit(self, scheduler_outputs: SchedulerOutputs, records: list[RequestRecord]) -> None:
        finished, self._finished_request_ids = self._finished_request_ids, []
        if self.scheduler.draft_planner is not None:
            self.scheduler.draft_planner.release(finished)
        try:
            self.batch_queue.submit(
                scheduler_outputs, records, finished, self.scheduler.kv_blocks_bound()
            )
        except MessageNotSerializableError as error:
            # Nothing was sent: the stages hold what they held (nothing is committed).
            self._finished_request_ids[:0] = finished  # not told to the stages yet
            self._refuse_unsendable(scheduler_outputs, error)
            return
        self.scheduler.commit_step(scheduler_outputs)

    def _refuse_unsendable(
        self, scheduler_outputs: SchedulerOutputs, error: MessageNotSerializableError
    ) -> None:
        """A scheduled step could not be serialised; nothing of it was sent (the stages are in
        step). `add_request` refuses such parameters, so this is a backstop (a processor that
        became unpicklable later): the requests whose parameters no longer serialise finish as
        aborted, with an error in the log; the step's other requests are recomputed."""
        groups = scheduler_outputs.scheduled_seq_groups
        culprits = []
        for group in groups:
            try:
                check_sendable(group.sampling_params)
            except TypeError as exc:
                culprits.append((group, str(exc)))
        if not culprits:  # not one request's fault: fail them all rather than loop
            culprits = [(group, str(error)) for group in groups]
        for group, why in culprits:
            logger.error("Request %s failed: its step could not be sent: %s", group.request_id, why)
            self.end_as_failed([group], f"its step could not be sent: {why}")
        # The batches already sent stay valid, but the unsent one's requests hold flights the
        # pipeline will never return: recompute everything in flight, as after an interrupt.
        self.discard_in_flight()

    def step(self) -> list[EngineOutput]:
        """Fill the pipeline with new batches, then finish the oldest one.

        Returns the RequestOutputs of the groups in that batch (and of prompts ignored as
        too long). Raises EngineDeadError once a stage failure could not be recovered."""
        self._check_alive()
        self.num_steps += 1
        try:
            outputs = self._step()
            self.resilience.after_step()
            if self.resilience.has_work_between_steps():
                # Kept in the pending outputs: a failed reshape check still returns them.
                self._pending_outputs[:0] = outputs
                self.resilience.between_steps()
                outputs = self._take_pending_outputs()
            return outputs
        except StageFailedError as error:
            return self._recover(error)
        except BaseException:
            # An interrupt or an error: the batches in flight will never be processed.
            self.discard_in_flight()
            raise

    def _step(self) -> list[EngineOutput]:
        ignored_groups: list[SequenceGroup] = []
        while not self.batch_queue.is_full():
            with sigint_deferred():
                records, sched_out = self.scheduler.schedule(self.batch_queue.next_step_no)
                for group in sched_out.ignored_seq_groups:
                    group.metrics.finished_time = time.time()
                    self._pending_outputs.append(output_of_group(group))
                    group.final_output_returned = True
                    ignored_groups.append(group)
                    self._finished_request_ids.append(group.request_id)
            if sched_out.is_empty():
                break
            self._submit(sched_out, records)
        if not self.batch_queue:
            if self.stats is not None and ignored_groups:
                self.stats.after_batch(None, None, [], ignored_groups)
            return self._take_pending_outputs()
        request_outputs = self._collect_oldest(ignored_groups)
        return self._take_pending_outputs() + request_outputs

    def _collect_oldest(self, ignored_groups: list[SequenceGroup]) -> list[EngineOutput]:
        """Wait for the oldest batch in the pipeline and process its tokens."""
        with sigint_deferred():
            sched_out, output = self.batch_queue.collect_oldest()
            groups = sched_out.scheduled_seq_groups
            before = self.stats.before_batch(groups) if self.stats is not None else []
            # Out of flight first: this releases groups aborted meanwhile (their blocks too).
            self.scheduler.finish_in_flight([g.request_id for g in groups])
            self._fail_errored_requests(groups, output)
            request_outputs = self.output_processor.process(groups, output)
            sizer, seconds = self.scheduler.chunk_sizer, self.batch_queue.last_step_s
            if sizer is not None and seconds is not None:
                sizer.observe(sched_out.cost, seconds)
            planner = self.scheduler.draft_planner
            if planner is not None and sched_out.drafts:
                planner.observe(step_outcome(sched_out.drafts, groups, output))
            self._finished_request_ids.extend(g.request_id for g in groups if g.is_finished())
            self.scheduler.free_finished_seq_groups()
            if self.stats is not None:
                self.stats.after_batch(sched_out, output, before, ignored_groups)
        return request_outputs

    def _fail_errored_requests(self, groups: list[SequenceGroup], output: Any) -> None:
        """End the requests the last stage marked failed (their own sampling work raised);
        their placeholder tokens are never applied. The stage is healthy: nothing else
        changes."""
        for group, group_output in zip(groups, output or ()):
            error = getattr(group_output, "error", None)
            if error is None or group.is_finished() or getattr(group_output, "recompute", False):
                continue
            logger.error("Request %s failed in the last stage: %s", group.request_id, error)
            self.end_as_failed([group], error)

    def _take_pending_outputs(self) -> list[EngineOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def drain(self) -> None:
        """Collect every batch inside the pipeline; their outputs wait in the pending outputs
        (returned by the next step). A stage failing meanwhile is recovered as in a step
        (everything is re-queued then, and nothing stays in flight)."""
        while self.batch_queue:
            try:
                self._pending_outputs.extend(self._collect_oldest([]))
            except StageFailedError as error:
                self.resilience.recover(error)  # its outputs stay pending
            except BaseException:
                self.discard_in_flight()
                raise

    def abandon_in_flight(self) -> list[BlockOps]:
        """A stage failed or the pipeline re-formed: the batches in flight never come back.
        Forget them (the scheduler's groups stay as committed) and return the block
        operations of steps no rank received (a stage-local rebuild applies them first)."""
        unsent = self.batch_queue.unsent_block_ops()
        self.batch_queue.reset()
        return unsent

    def requests_of_call(self, call_id: int | None) -> list[str]:
        """The requests of the in-flight step the executor numbered `call_id`."""
        return self.batch_queue.request_ids_of_call(call_id)

    def log_fault(self, event: FaultEvent) -> None:
        """Count a stage failure and its recovery's work in the metrics (stats on)."""
        if self.stats is not None:
            self.stats.log_fault(event, event.recomputed_tokens)

    def discard_in_flight(self) -> None:
        """Forget the batches inside the pipeline and recompute their requests.

        Stages still run the abandoned steps, but before any later one (an actor runs its
        calls in order), so blocks the abandoned steps write are rewritten by the recompute
        or by their next owner afterwards."""
        if not self.executor.is_shut_down:
            self.batch_queue.discard()
        requeued = self.scheduler.requeue_in_flight()
        if requeued:
            logger.warning(
                "Step interrupted: %d in-flight requests re-queued for recompute", len(requeued)
            )

    def _recover(self, error: StageFailedError) -> list[EngineOutput]:
        """Replace the failed stages and bring their KV back (`vllm.resilience.coordinator`);
        or, when restarts are used up or replacing fails, abort everything, release the
        workers and raise."""
        self.resilience.recover(error)
        return self._take_pending_outputs()

    @property
    def fault_events(self) -> list[FaultEvent]:
        """Stage failures seen, each with its detection and recovery times and the work its
        recovery recomputed (`vllm.resilience.events.FaultEvent`)."""
        return self.resilience.events

    def end_as_failed(self, groups: list[SequenceGroup], why: str) -> None:
        """Abort `groups` (their error already logged) and return their final outputs
        (finish_reason "abort") with this step's; `why` is kept for `pop_request_error`."""
        ids = [group.request_id for group in groups]
        for request_id in ids:
            self._request_errors[request_id] = RequestFailedError([request_id], why)
        # Offline callers never take them: keep the newest only.
        while len(self._request_errors) > _MAX_KEPT_REQUEST_ERRORS:
            del self._request_errors[next(iter(self._request_errors))]
        self.scheduler.abort_seq_group(ids)
        self._finished_request_ids.extend(ids)
        for group in groups:
            group.metrics.finished_time = time.time()
            self._pending_outputs.append(output_of_group(group))
            group.final_output_returned = True

    def fail(self, error: StageFailedError, why: str) -> NoReturn:
        """Fail-stop: abort every unfinished request, release the workers, raise."""
        if self.stats is not None and self.fault_events:
            self.stats.log_fault(self.fault_events[-1], 0)
        groups = [*self.scheduler.waiting, *self.scheduler.running, *self.scheduler.swapped]
        self.scheduler.abort_seq_group([g.request_id for g in groups])
        self._dead = EngineDeadError(
            f"{error} -- the engine stopped ({why}); {len(groups)} unfinished requests were "
            "aborted and the workers released. Build a new LLM to continue."
        )
        self._dead.__cause__ = error
        self.executor.shutdown(graceful=False)
        raise self._dead from error

    def shutdown(self) -> None:
        """Stop the workers (Ray actors and process groups); safe to call twice."""
        executor: ExecutorBase | None = getattr(self, "executor", None)
        if executor is not None:  # None: the engine failed before it had one
            executor.shutdown()
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None and scheduler.draft_planner is not None:
            scheduler.draft_planner.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter teardown: nothing left to clean up with
            pass


def _check_token_type_ids(
    token_type_ids: Any, pooling_params: PoolingParams | None, prompt_token_ids: list[int]
) -> list[int]:
    """A prompt's `token_type_ids` (an encoder's pair input): one int per prompt token (the
    last ones when the prompt was truncated), for a pooling request only."""
    if pooling_params is None:
        raise ValueError("token_type_ids: only pooling requests (score, rerank) take them.")
    if not isinstance(token_type_ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in token_type_ids
    ):
        raise TypeError("token_type_ids must be a list of ints.")
    if len(token_type_ids) < len(prompt_token_ids):
        raise ValueError(
            f"token_type_ids has {len(token_type_ids)} entries for {len(prompt_token_ids)} "
            "prompt tokens."
        )
    return list(token_type_ids[len(token_type_ids) - len(prompt_token_ids) :])


def _default_task(convert: str) -> str:
    """The pooling task a request without one runs (the model's main task)."""
    return {"embed": "embed", "classify": "classify"}.get(convert, "encode")


def _pooling_placeholder(params: PoolingParams, model_config: ModelConfig) -> SamplingParams:
    """What the scheduler sees of a pooling request: a prompt that ends after its prefill
    (one token at most, never sampled), truncated as `truncate_prompt_tokens` asks."""
    truncate = params.truncate_prompt_tokens
    if truncate == -1:
        truncate = model_config.max_model_len
    return SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, truncate_prompt_tokens=truncate
    )


def _first_name(name: Any) -> str | None:
    """The first of vLLM's served model names (one string or a list)."""
    if isinstance(name, (list, tuple)):
        return str(name[0]) if name else None
    return name


def _make_stats_collector(scheduler: Scheduler, loggers: dict[str, Any]) -> Any:
    from vllm.engine.metrics import EngineStatsCollector

    return EngineStatsCollector(scheduler, loggers)


def _load_generation_config(model_config: ModelConfig) -> dict[str, Any]:
    """The model directory's generation_config.json as a dict ({} if there is none)."""
    path = os.path.join(model_config.model, "generation_config.json")
    if model_config.is_gguf or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _eos_token_id(tokenizer: Any, model_config: ModelConfig) -> int | None:
    """The tokenizer's EOS id, else the model config's (the first, if it lists several)."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(model_config.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
    return eos


def _load_tokenizer(model_config: ModelConfig) -> Any:
    if model_config.is_gguf and model_config.tokenizer == model_config.model:
        from vllm.transformers_utils.gguf_config import load_gguf_tokenizer

        return load_gguf_tokenizer(model_config.model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
    )


def _pipelining(
    scheduler_config: SchedulerConfig, executor: ExecutorBase
) -> tuple[MicroBatchBudget, bool]:
    """One batch's budget (a cohort per stage) and whether decodes are scheduled ahead, for
    the executor's pipeline as it is now."""
    budget = MicroBatchBudget.for_pipeline(scheduler_config, executor.max_concurrent_batches)
    return budget, _use_async_pipeline(scheduler_config, executor)


def _use_async_pipeline(scheduler_config: SchedulerConfig, executor: ExecutorBase) -> bool:
    """Async scheduling needs stage processes of their own (the first stage receives the last
    stage's sampled ids) and pipeline parallelism; None means on where it can be."""
    supported = bool(executor.supports_async_pipeline)
    wanted = scheduler_config.async_scheduling
    if wanted and not supported:
        logger.warning(
            "async_scheduling needs pipeline_parallel_size > 1 on the ray or mp backend; "
            "running without it"
        )
    return supported and wanted is not False


def _chunk_sizer(engine_config: EngineConfig) -> ChunkSizer | None:
    """The scheduler's chunk sizer with chunked prefill and `VLLM_PP_DYNAMIC_CHUNKS=1`; None
    otherwise (chunks of the whole room, as vLLM cuts them: nothing to time or fit)."""
    if not (
        engine_config.scheduler_config.enable_chunked_prefill
        and envs.get_bool("VLLM_PP_DYNAMIC_CHUNKS")
    ):
        return None
    mc = engine_config.model_config
    layer, _ = mc.get_gemm_shapes()
    prior = prior_pair_cost(
        sum(n * k for n, k in layer), mc.get_num_attention_heads(), mc.get_head_size()
    )
    return ChunkSizer(prior)


def _draft_planner(engine_config: EngineConfig) -> DraftPlanner | None:
    """The scheduler's draft planner when speculative decoding is on."""
    spec = engine_config.speculative_config
    if spec is None:
        return None
    if engine_config.model_config.runner_type == "pooling":
        raise ValueError("Speculative decoding is not supported for pooling models.")
    lookup = ""
    if spec.method == "ngram":
        lookup = f", prompt_lookup_max={spec.prompt_lookup_max}"
        lookup += f", prompt_lookup_min={spec.prompt_lookup_min}"
    name = spec.method if spec.model is None else f"draft model {spec.model!r}"
    logger.info(
        "Speculative decoding: %s, num_speculative_tokens=%d%s",
        name,
        spec.num_speculative_tokens,
        lookup,
    )
    proposer = None
    if spec.method == "draft_model":
        draft_config = _draft_config(engine_config)
        proposer = DraftModelProposer(lambda: _make_executor(draft_config))
    return DraftPlanner(spec, engine_config.scheduler_config.max_model_len, proposer)


def _draft_config(engine_config: EngineConfig) -> EngineConfig:
    """The draft model's stage (placed by VLLM_SPEC_DRAFT_PLACEMENT), checked against the
    target's vocabulary: the drafts are token ids of the target's tokenizer."""
    from vllm.engine.arg_utils import EngineArgs

    placement = envs.get_str("VLLM_SPEC_DRAFT_PLACEMENT")
    kwargs = draft_engine_kwargs(engine_config, placement)
    draft = EngineArgs(**kwargs).create_engine_config()
    target_vocab = engine_config.model_config.get_vocab_size()
    draft_vocab = draft.model_config.get_vocab_size()
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft_vocab} tokens) is not "
            f"the target's ({target_vocab}); they must share a tokenizer."
        )
    return draft


def _make_executor(engine_config: EngineConfig) -> ExecutorBase:
    backend = engine_config.parallel_config.distributed_executor_backend
    if backend == "ray":
        from vllm.executor.ray_executor import RayExecutor

        return RayExecutor(engine_config)
    if backend == "mp":
        from vllm.executor.mp_executor import MultiprocessingExecutor

        return MultiprocessingExecutor(engine_config)
    from vllm.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor(engine_config)
