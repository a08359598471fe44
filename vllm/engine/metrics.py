"""Engine statistics with vLLM's metric names: a `Stats` snapshot per step, Prometheus
collectors (`vllm:num_requests_running`, `vllm:num_preemptions_total`, ...) and vLLM's
periodic throughput log line.

The offline engine and the server share this. Collection is cheap (a few counters per step,
one pass over the batch's groups) and only happens when stats are enabled
(`disable_log_stats=False`). The Prometheus registry is process-global: each engine that logs
stats registers fresh collectors (labelled by model name) in place of the previous engine's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger
from vllm.sequence import SequenceStatus
from vllm.spec_decode.planner import SpecOutcome, step_outcome

logger = init_logger("vllm.engine.metrics")

# vLLM V0 logs the throughput line at most this often.
LOCAL_LOGGING_INTERVAL_SEC = 5.0

_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0]  # fmt: skip
_RECOVERY_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0]
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0]  # fmt: skip
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
_PARAM_BUCKETS = [1, 2, 5, 10, 20]  # vLLM's for request_params_n / request_params_best_of


@dataclass
class Stats:
    """What one engine step (or an idle refresh) reports: queue sizes and cache usage now,
    plus the tokens, latencies and finished requests of the batch it completed."""

    now: float
    num_running: int
    num_waiting: int
    num_swapped: int
    gpu_cache_usage: float  # fraction of device KV blocks in use
    cpu_cache_usage: float  # fraction of swap blocks in use
    # Cached prefix blocks found / looked up since start (-1 with prefix caching off).
    gpu_prefix_cache_hit_rate: float = -1.0
    num_preemptions: int = 0  # new preemptions since the previous Stats
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    time_per_output_tokens: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finished_prompt_tokens: list[int] = field(default_factory=list)
    finished_generation_tokens: list[int] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)
    finished_best_of: list[int] = field(default_factory=list)
    finished_n: list[int] = field(default_factory=list)
    # The batch's speculative decodes (None: it had none).
    spec_decode: SpecOutcome | None = None

    # vLLM 0.5's field names, for stat loggers written against vLLM's `Stats`.
    num_running_sys = property(lambda self: self.num_running)
    num_waiting_sys = property(lambda self: self.num_waiting)
    num_swapped_sys = property(lambda self: self.num_swapped)
    gpu_cache_usage_sys = property(lambda self: self.gpu_cache_usage)
    cpu_cache_usage_sys = property(lambda self: self.cpu_cache_usage)
    num_prompt_tokens_iter = property(lambda self: self.num_prompt_tokens)
    num_generation_tokens_iter = property(lambda self: self.num_generation_tokens)
    time_to_first_tokens_iter = property(lambda self: self.time_to_first_tokens)
    time_per_output_tokens_iter = property(lambda self: self.time_per_output_tokens)
    num_preemption_iter = property(lambda self: self.num_preemptions)
    time_e2e_requests = property(lambda self: self.e2e_latencies)
    num_prompt_tokens_requests = property(lambda self: self.finished_prompt_tokens)
    num_generation_tokens_requests = property(lambda self: self.finished_generation_tokens)
    best_of_requests = property(lambda self: self.finished_best_of)
    n_requests = property(lambda self: self.finished_n)
    finished_reason_requests = property(lambda self: self.finished_reasons)
    spec_decode_metrics = property(lambda self: self.spec_decode)


class PrometheusMetrics:
    """vLLM's Prometheus collectors (see `new_prometheus_metrics`)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        label = ["model_name"]
        self.num_requests_running = Gauge(
            "vllm:num_requests_running", "Number of requests currently running.", label
        )
        self.num_requests_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", label
        )
        self.num_requests_swapped = Gauge(
            "vllm:num_requests_swapped", "Number of requests swapped to CPU.", label
        )
        self.gpu_cache_usage = Gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", label
        )
        self.cpu_cache_usage = Gauge(
            "vllm:cpu_cache_usage_perc", "CPU swap usage. 1 means 100 percent usage.", label
        )
        self.gpu_prefix_cache_hit_rate = Gauge(
            "vllm:gpu_prefix_cache_hit_rate",
            "GPU prefix cache block hit rate.",
            label,
        )
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine.", label
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", label
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", label
        )
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            label,
            buckets=_TTFT_BUCKETS,
        )
        self.time_per_output_token = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            label,
            buckets=_TPOT_BUCKETS,
        )
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            label,
            buckets=_REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            label,
            buckets=_TOKEN_BUCKETS,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            label,
            buckets=_TOKEN_BUCKETS,
        )
        self.request_params_n = Histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            label,
            buckets=_PARAM_BUCKETS,
        )
        self.request_params_best_of = Histogram(
            "vllm:request_params_best_of",
            "Histogram of the best_of request parameter.",
            label,
            buckets=_PARAM_BUCKETS,
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
        )
        self.avg_prompt_throughput = Gauge(
            "vllm:avg_prompt_throughput_toks_per_s",
            "Average prefill throughput in tokens/s.",
            label,
        )
        self.avg_generation_throughput = Gauge(
            "vllm:avg_generation_throughput_toks_per_s",
            "Average generation throughput in tokens/s.",
            label,
        )
        # Pipeline faults (vllm-pp's own; vLLM is fail-stop), in vLLM's naming style.
        self.stage_failures = Counter(
            "vllm:stage_failures", "Number of pipeline stage failures detected.", label
        )
        self.stage_recoveries = Counter(
            "vllm:stage_recoveries", "Number of failed stages replaced while serving.", label
        )
        self.stage_failure_detection = Histogram(
            "vllm:stage_failure_detection_seconds",
            "Histogram of the time from a step's wait to a stage failure being known.",
            label,
            buckets=_RECOVERY_BUCKETS,
        )
        self.stage_recovery = Histogram(
            "vllm:stage_recovery_seconds",
            "Histogram of the time to replace failed stages and serve again.",
            label,
            buckets=_RECOVERY_BUCKETS,
        )
        self.recomputed_tokens = Counter(
            "vllm:recomputed_tokens",
            "Number of tokens re-prefilled because a stage lost its KV cache.",
            label,
        )
        # Speculative decoding (vLLM's names).
        self.spec_decode_num_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", label
        )
        self.spec_decode_num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", label
        )
        self.spec_decode_num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", label
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["model_name", "position"],
        )
        self.recomputed_token_stages = Counter(
            "vllm:recomputed_token_stages",
            "Recovery work in token-stages: tokens re-prefilled times the stages that ran "
            "them (a full recompute: x pipeline_parallel_size; a stage-local rebuild: x the "
            "stages rebuilt).",
            label,
        )

    # vLLM 0.5's attribute names (`stat_loggers["prometheus"].metrics.counter_prompt_tokens`).
    gauge_scheduler_running = property(lambda self: self.num_requests_running)
    gauge_scheduler_waiting = property(lambda self: self.num_requests_waiting)
    gauge_scheduler_swapped = property(lambda self: self.num_requests_swapped)
    gauge_gpu_cache_usage = property(lambda self: self.gpu_cache_usage)
    gauge_cpu_cache_usage = property(lambda self: self.cpu_cache_usage)
    counter_num_preemption = property(lambda self: self.num_preemptions)
    counter_prompt_tokens = property(lambda self: self.prompt_tokens)
    counter_generation_tokens = property(lambda self: self.generation_tokens)
    histogram_time_to_first_token = property(lambda self: self.time_to_first_token)
    histogram_time_per_output_token = property(lambda self: self.time_per_output_token)
    histogram_e2e_time_request = property(lambda self: self.e2e_request_latency)
    histogram_num_prompt_tokens_request = property(lambda self: self.request_prompt_tokens)
    histogram_num_generation_tokens_request = property(lambda self: self.request_generation_tokens)
    histogram_best_of_request = property(lambda self: self.request_params_best_of)
    histogram_n_request = property(lambda self: self.request_params_n)
    counter_request_success = property(lambda self: self.request_success)
    gauge_avg_prompt_throughput = property(lambda self: self.avg_prompt_throughput)
    gauge_avg_generation_throughput = property(lambda self: self.avg_generation_throughput)


_metrics_lock = threading.Lock()


def new_prometheus_metrics() -> PrometheusMetrics:
    """Fresh collectors in prometheus_client's default REGISTRY, replacing any earlier
    engine's (as vLLM does): the registry is process-global, and the newest engine's counts
    are the ones a scrape or a test reads."""
    import prometheus_client

    # Counters would otherwise also export `*_created` timestamp samples.
    prometheus_client.disable_created_metrics()
    registry = prometheus_client.REGISTRY
    with _metrics_lock:
        for collector in list(registry._collector_to_names):
            names = registry._collector_to_names.get(collector, ())
            if any(name.startswith("vllm:") for name in names):
                registry.unregister(collector)
        return PrometheusMetrics()


class StatLoggerBase:
    """vLLM's base of the stat loggers an engine feeds (`LLMEngine.add_logger`): `log` gets
    every step's `Stats`, `info` the engine's configuration once (`"cache_config"`)."""

    def __init__(self, local_interval: float = LOCAL_LOGGING_INTERVAL_SEC) -> None:
        self.local_interval = local_interval
        self.last_local_log = time.time()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def log(self, stats: Stats) -> None:
        raise NotImplementedError

    def info(self, type: str, obj: Any) -> None:
        raise NotImplementedError

    def _interval_throughput(self, stats: Stats) -> tuple[float, float] | None:
        """Prompt and generation tokens/s over the interval, once it has passed."""
        self.num_prompt_tokens += stats.num_prompt_tokens
        self.num_generation_tokens += stats.num_generation_tokens
        elapsed = stats.now - self.last_local_log
        if elapsed < self.local_interval:
            return None
        result = (self.num_prompt_tokens / elapsed, self.num_generation_tokens / elapsed)
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.last_local_log = stats.now
        return result


class LoggingStatLogger(StatLoggerBase):
    """vLLM's throughput line, every `local_interval` seconds (and vLLM's speculative
    decoding line after it when drafts were verified in the interval)."""

    def __init__(self, local_interval: float = LOCAL_LOGGING_INTERVAL_SEC) -> None:
        super().__init__(local_interval)
        self._spec = SpecOutcome()

    def log(self, stats: Stats) -> None:
        if stats.spec_decode is not None:
            self._spec.add(stats.spec_decode)
        throughput = self._interval_throughput(stats)
        if throughput is not None:
            logger.info(format_log_line(stats, *throughput))
            if self._spec.num_drafts:
                logger.info(format_spec_line(self._spec))
                self._spec = SpecOutcome()

    def info(self, type: str, obj: Any) -> None:
        pass  # the configuration is logged when the engine starts


class StatLogger(StatLoggerBase):
    """Feeds each step's Stats to vLLM's Prometheus collectors (labelled by model name)."""

    def __init__(self, model_name: str, local_interval: float = LOCAL_LOGGING_INTERVAL_SEC):
        super().__init__(local_interval)
        self.model_name = model_name
        self.labels = {"model_name": model_name}  # vLLM's: every collector's label values
        metrics = new_prometheus_metrics()
        self.metrics = metrics
        # Children bound once: .labels() looks up a dict under a lock on every call.
        m = model_name
        self._running = metrics.num_requests_running.labels(m)
        self._waiting = metrics.num_requests_waiting.labels(m)
        self._swapped = metrics.num_requests_swapped.labels(m)
        self._gpu = metrics.gpu_cache_usage.labels(m)
        self._cpu = metrics.cpu_cache_usage.labels(m)
        self._prefix_hits = metrics.gpu_prefix_cache_hit_rate.labels(m)
        self._preempt = metrics.num_preemptions.labels(m)
        self._prompt = metrics.prompt_tokens.labels(m)
        self._gen = metrics.generation_tokens.labels(m)
        self._ttft = metrics.time_to_first_token.labels(m)
        self._tpot = metrics.time_per_output_token.labels(m)
        self._e2e = metrics.e2e_request_latency.labels(m)
        self._req_prompt = metrics.request_prompt_tokens.labels(m)
        self._req_gen = metrics.request_generation_tokens.labels(m)
        self._req_n = metrics.request_params_n.labels(m)
        self._req_best_of = metrics.request_params_best_of.labels(m)

    def info(self, type: str, obj: Any) -> None:
        """`info("cache_config", cache_config)`: vLLM's `vllm:cache_config_info` gauge (1,
        the config's fields as labels)."""
        if type != "cache_config":
            return
        from prometheus_client import Gauge

        labels = obj.metrics_info()
        with _metrics_lock:
            gauge = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                list(labels),
            )
        gauge.labels(**labels).set(1)

    def log_fault(self, event: Any, recomputed_tokens: int) -> None:
        """One stage failure (a FaultEvent), after the engine replaced the stages or gave up."""
        m, labels = self.metrics, (self.model_name,)
        m.stage_failures.labels(*labels).inc()
        m.stage_failure_detection.labels(*labels).observe(event.detected_after_s)
        if event.recovery_s is not None:
            m.stage_recoveries.labels(*labels).inc()
            m.stage_recovery.labels(*labels).observe(event.recovery_s)
            m.recomputed_tokens.labels(*labels).inc(recomputed_tokens)
            m.recomputed_token_stages.labels(*labels).inc(event.recomputed_token_stages)

    def log(self, stats: Stats) -> None:
        """Record one Stats; the average throughput gauges every interval."""
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._swapped.set(stats.num_swapped)
        self._gpu.set(stats.gpu_cache_usage)
        self._cpu.set(stats.cpu_cache_usage)
        self._prefix_hits.set(stats.gpu_prefix_cache_hit_rate)
        if stats.num_preemptions:
            self._preempt.inc(stats.num_preemptions)
        if stats.num_prompt_tokens:
            self._prompt.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self._gen.inc(stats.num_generation_tokens)
        for histogram, values in (
            (self._ttft, stats.time_to_first_tokens),
            (self._tpot, stats.time_per_output_tokens),
            (self._e2e, stats.e2e_latencies),
            (self._req_prompt, stats.finished_prompt_tokens),
            (self._req_gen, stats.finished_generation_tokens),
            (self._req_n, stats.finished_n),
            (self._req_best_of, stats.finished_best_of),
        ):
            for value in values:
                histogram.observe(value)
        for reason in stats.finished_reasons:
            self.metrics.request_success.labels(self.model_name, reason).inc()
        spec = stats.spec_decode
        if spec is not None:
            m, name = self.metrics, self.model_name
            m.spec_decode_num_drafts.labels(name).inc(spec.num_drafts)
            m.spec_decode_num_draft_tokens.labels(name).inc(spec.num_draft_tokens)
            m.spec_decode_num_accepted_tokens.labels(name).inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.accepted_per_pos):
                m.spec_decode_num_accepted_tokens_per_pos.labels(name, str(position)).inc(count)
        throughput = self._interval_throughput(stats)
        if throughput is not None:
            self.metrics.avg_prompt_throughput.labels(self.model_name).set(throughput[0])
            self.metrics.avg_generation_throughput.labels(self.model_name).set(throughput[1])


class PrometheusStatLogger(StatLogger):
    """vLLM 0.5's constructor: `(local_interval, labels={"model_name": ...}, max_model_len)`."""

    def __init__(
        self, local_interval: float, labels: dict[str, str], max_model_len: int = 0
    ) -> None:
        super().__init__(labels.get("model_name", "vllm"), local_interval)


def default_stat_loggers(model_name: str) -> dict[str, StatLoggerBase]:
    """What an engine with stats on logs to, under vLLM's keys."""
    return {"logging": LoggingStatLogger(), "prometheus": StatLogger(model_name)}


def format_log_line(stats: Stats, prompt_throughput: float, generation_throughput: float) -> str:
    """vLLM V0's periodic line (same wording, so log scrapers keep working)."""
    return (
        f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
        f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
        f"Running: {stats.num_running} reqs, Swapped: {stats.num_swapped} reqs, "
        f"Pending: {stats.num_waiting} reqs, "
        f"GPU KV cache usage: {stats.gpu_cache_usage * 100:.1f}%, "
        f"CPU KV cache usage: {stats.cpu_cache_usage * 100:.1f}%."
    )


def format_spec_line(spec: SpecOutcome) -> str:
    """vLLM V1's speculative decoding line (its wording) for the drafts of one interval."""
    per_pos = ", ".join(f"{count / spec.num_drafts:.3f}" for count in spec.accepted_per_pos)
    return (
        "SpecDecoding metrics: "
        f"Mean acceptance length: {1 + spec.num_accepted_tokens / spec.num_drafts:.2f}, "
        f"Accepted: {spec.num_accepted_tokens} tokens, "
        f"Drafted: {spec.num_draft_tokens} tokens, "
        f"Per-position acceptance rate: {per_pos}, "
        f"Avg Draft acceptance rate: {spec.acceptance_rate * 100:.1f}%"
    )


class EngineStatsCollector:
    """Builds Stats from the engine's scheduler around each completed batch.

    `before_batch` notes the batch's groups' token times (for TTFT and TPOT) before their new
    tokens are applied; `after_batch` builds the Stats and hands them to every logger of
    `loggers` (the engine's `stat_loggers`, the same dict, so added loggers are fed too)."""

    def __init__(self, scheduler: Any, loggers: dict[str, StatLoggerBase]) -> None:
        self.scheduler = scheduler
        self.loggers = loggers
        self._preemptions_seen = scheduler.num_cumulative_preemption

    @property
    def stat_logger(self) -> StatLogger | None:
        """The Prometheus logger (stage-fault metrics go there), if any."""
        found = self.loggers.get("prometheus")
        return found if isinstance(found, StatLogger) else None

    def log_fault(self, event: Any, recomputed_tokens: int) -> None:
        if self.stat_logger is not None:
            self.stat_logger.log_fault(event, recomputed_tokens)

    def _log(self, stats: Stats) -> None:
        for stat_logger in list(self.loggers.values()):
            stat_logger.log(stats)

    def before_batch(self, groups: list[Any]) -> list[tuple[float | None, float]]:
        return [(g.metrics.first_token_time, g.metrics.last_token_time) for g in groups]

    def snapshot(self) -> Stats:
        """Queue sizes, cache usage and the preemptions since the previous snapshot."""
        sched = self.scheduler
        bm = sched.block_manager
        total_gpu = bm.num_total_gpu_blocks
        total_cpu = bm.num_total_cpu_blocks
        gpu = 1.0 - bm.get_num_free_gpu_blocks() / total_gpu if total_gpu else 0.0
        cpu = 1.0 - bm.get_num_free_cpu_blocks() / total_cpu if total_cpu else 0.0
        preemptions = sched.num_cumulative_preemption
        stats = Stats(
            now=time.time(),
            num_running=sum(1 for g in sched.running if not g.is_finished()),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            gpu_cache_usage=gpu,
            cpu_cache_usage=cpu,
            num_preemptions=preemptions - self._preemptions_seen,
            gpu_prefix_cache_hit_rate=bm.get_prefix_cache_hit_rate(),
        )
        self._preemptions_seen = preemptions
        return stats

    def after_batch(
        self,
        sched_out: Any,
        output: Any,
        before: list[tuple[float | None, float]],
        ignored: list[Any],
    ) -> None:
        """Record a completed batch (`output` is its SamplerOutput) and the ignored groups."""
        stats = self.snapshot()
        if sched_out is not None:
            if sched_out.prompt_run:
                stats.num_prompt_tokens = sched_out.num_batched_tokens
            stats.num_generation_tokens = sum(
                1 + len(s.accepted or ()) for o in output for s in o.samples
            )
            if sched_out.drafts:
                stats.spec_decode = step_outcome(
                    sched_out.drafts, sched_out.scheduled_seq_groups, output
                )
            for group, (first, last) in zip(sched_out.scheduled_seq_groups, before):
                m = group.metrics
                if m.first_token_time is None:
                    continue  # aborted while in flight
                if first is None:
                    stats.time_to_first_tokens.append(m.first_token_time - m.arrival_time)
                elif m.last_token_time != last:
                    stats.time_per_output_tokens.append(m.last_token_time - last)
                if group.is_finished() and not _aborted(group):
                    self._finished(stats, group)
        for group in ignored:
            self._finished(stats, group)
        self._log(stats)

    def refresh(self) -> None:
        """Update the gauges without a batch (after aborts on an idle engine)."""
        self._log(self.snapshot())

    @staticmethod
    def _finished(stats: Stats, group: Any) -> None:
        m = group.metrics
        end = m.finished_time if m.finished_time is not None else stats.now
        stats.e2e_latencies.append(end - m.arrival_time)
        stats.finished_prompt_tokens.append(len(group.prompt_token_ids))
        stats.finished_generation_tokens.append(
            sum(len(s.get_output_token_ids()) for s in group.get_seqs())
        )
        params = group.sampling_params
        if params is not None:
            stats.finished_n.append(params.n)
            stats.finished_best_of.append(params.best_of)
        seq = group.get_seqs()[0]
        reason = SequenceStatus.get_finished_reason(seq.status)
        if reason is not None:
            stats.finished_reasons.append(reason)


def _aborted(group: Any) -> bool:
    return any(s.status == SequenceStatus.FINISHED_ABORTED for s in group.get_seqs())
