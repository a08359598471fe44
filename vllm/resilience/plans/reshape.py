"""Reshape: the decoder layers move between the same stages while the engine serves, on
demand (`LLMEngine.reshape_pipeline`, the server's admin route) or automatically from the
stages' measured compute times (a rebalance: `--pp-auto-rebalance`).

A reshape drains the pipeline (the batches inside it are collected and their tokens kept),
re-queues every request for recompute (`Scheduler.requeue_all`: the KV is rebuilt by
re-prefilling the tokens each request has), has every stage take its new layers and re-size
its KV cache (`executor.reshape_pipeline`), and gives the block manager the new minimum block
count over stages. Greedy and seeded outputs are unchanged: seeded draws are re-seeded from
the tokens generated (`sampling_metadata.sample_seed`), as after a stage replacement.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.layer_split import rebalanced_layer_sizes, validate_layer_split
from vllm.logger import init_logger
from vllm.resilience.engine_control import EngineControl
from vllm.resilience.errors import StageFailedError
from vllm.resilience.events import ReshapeEvent
from vllm.worker.stage_report import StageStats

logger = init_logger("vllm.resilience.plans.reshape")

# Recovers a stage failure met during a reshape (the coordinator's `recover`).
Recover = Callable[[StageFailedError], None]

# The automatic reshape looks at the stages' times at most this often (seconds) ...
AUTO_INTERVAL_S = 5.0
# ... and only over a window of at least this many steps per stage.
AUTO_MIN_STEPS = 16
# After a reshape (which recomputes every request) the next automatic one waits this long:
# noisy times must not make the pipeline flip between two splits.
AUTO_COOLDOWN_S = 30.0


class PipelineReshaper:
    """The engine's reshapes: does them, decides the automatic ones (rebalances), keeps their
    record."""

    def __init__(self, engine: EngineControl, recover: Recover) -> None:
        self.engine = engine
        self._recover = recover
        self.events: list[ReshapeEvent] = []
        pc = engine.parallel_config
        self.auto = bool(pc.pp_auto_rebalance) and pc.pipeline_parallel_size > 1
        self.min_gain = pc.pp_rebalance_min_gain
        self._window_start = time.monotonic()
        self._not_before = 0.0  # time.monotonic() before which no automatic reshape starts
        # Each rank's cumulative stats when the current window started (no reset: other
        # readers of get_stage_stats keep their own windows).
        self._baseline: list[StageStats] | None = None

    def current_split(self) -> list[int]:
        """Decoder layers per stage now."""
        engine = self.engine
        return engine.model_config.get_pp_layer_sizes(engine.parallel_config)

    # -- on demand -------------------------------------------------------------------------

    def reshape(self, layer_split: Any, reason: str = "request") -> ReshapeEvent:
        """Re-split the layers as `layer_split` (layers per stage). ValueError naming
        `layer_split` when it is not one positive integer per stage summing to the model's
        layers. Outputs collected while draining are returned by the engine's next step."""
        engine = self.engine
        pp = engine.parallel_config.pipeline_parallel_size
        sizes = validate_layer_split(layer_split, engine.model_config.get_num_layers(), pp)
        old = self.current_split()
        event = ReshapeEvent(old, sizes, reason)
        if sizes == old:
            logger.info("Pipeline reshape to %s: already the split, nothing to do", sizes)
            return event
        started = time.monotonic()
        engine.drain()
        event.recomputed_requests = len(engine.scheduler.requeue_all())
        self._reshape_stages(sizes, old)
        event.num_gpu_blocks = self.resize_block_manager()
        engine.loras.resync()  # stages that loaded new layers install the adapters again
        event.seconds = time.monotonic() - started
        self.events.append(event)
        self.restart_window()
        logger.info(
            "Pipeline reshaped (%s): layers per stage %s -> %s (%s) in %.2f s; # GPU blocks: "
            "%d; %d requests will be recomputed with the tokens they have",
            reason, old, sizes, _moves(old, sizes), event.seconds, event.num_gpu_blocks,
            event.recomputed_requests,
        )  # fmt: skip
        return event

    def _reshape_stages(self, sizes: list[int], old: list[int]) -> None:
        """Every stage takes its new layers and cache. A stage failing meanwhile is replaced
        (it loads the new split) and the reshape tried once more; a split whose caches hold
        too few blocks (ValueError) is undone before it is raised."""
        engine = self.engine
        try:
            engine.executor.reshape_pipeline(sizes)
        except StageFailedError as error:
            self._recover(error)  # its outputs are returned by the engine's next step
            engine.executor.reshape_pipeline(sizes)
        except ValueError:
            logger.error("Pipeline reshape to %s refused; going back to %s", sizes, old)
            engine.executor.reshape_pipeline(old)
            self.resize_block_manager()
            raise

    def resize_block_manager(self) -> int:
        """The block manager takes the stages' new minimum; returns the device block count."""
        cc = self.engine.cache_config
        assert cc.num_gpu_blocks is not None and cc.num_cpu_blocks is not None
        self.engine.scheduler.resize_kv_cache(cc.num_gpu_blocks, cc.num_cpu_blocks)
        return cc.num_gpu_blocks

    # -- automatic -------------------------------------------------------------------------

    def after_step(self) -> None:
        """With `pp_auto_rebalance`: every AUTO_INTERVAL_S, read the stages' compute times
        and reshape (rebalance) when the predicted step time gains at least `pp_rebalance_min_gain`
        (not within AUTO_COOLDOWN_S of the last automatic reshape)."""
        now = time.monotonic()
        if not self.auto or now - self._window_start < AUTO_INTERVAL_S or now < self._not_before:
            return
        engine = self.engine
        stats = engine.executor.get_stage_stats(reset=False)
        baseline = self._baseline
        if baseline is None:  # the first look: the window starts now
            self._baseline, self._window_start = stats, time.monotonic()
            return
        per_step = _stage_step_seconds(_window(stats, baseline))
        if per_step is None:
            return  # too few steps yet: the window goes on from the same baseline
        self._baseline, self._window_start = stats, time.monotonic()
        old = self.current_split()
        head_cost = engine.model_config.get_lm_head_cost_in_layers()
        new, measured, predicted = rebalanced_layer_sizes(old, per_step, head_cost)
        if new == old or predicted > measured * (1.0 - self.min_gain):
            return
        logger.info(
            "Stage compute per step %s s at layers %s: reshaping as %s (step %.4f s -> "
            "%.4f s predicted)",
            [round(s, 5) for s in per_step], old, new, measured, predicted,
        )  # fmt: skip
        self._not_before = time.monotonic() + AUTO_COOLDOWN_S
        event = self.reshape(new, reason="auto")
        event.stage_step_s = per_step
        event.measured_step_s = measured
        event.predicted_step_s = predicted

    def restart_window(self) -> None:
        self._window_start = time.monotonic()
        self._baseline = None


def _window(now: list[StageStats], then: list[StageStats]) -> list[StageStats]:
    """Each rank's stats since `then` (all of `now` where a reset happened in between)."""
    out = []
    for current, before in zip(now, then):
        if current.steps < before.steps:
            out.append(current)
            continue
        window = dataclasses.replace(current)
        window.steps = current.steps - before.steps
        window.compute_s = current.compute_s - before.compute_s
        out.append(window)
    return out


def _stage_step_seconds(stats: list[StageStats]) -> list[float] | None:
    """Mean compute seconds per step of each stage (its TP ranks' slowest), in stage order;
    None while a stage has run fewer than AUTO_MIN_STEPS steps."""
    per_stage: dict[int, float] = {}
    for stat in stats:
        if stat.steps < AUTO_MIN_STEPS:
            return None
        mean = stat.compute_s / stat.steps
        per_stage[stat.pp_rank] = max(per_stage.get(stat.pp_rank, 0.0), mean)
    return [per_stage[r] for r in sorted(per_stage)]


def _moves(old: list[int], new: list[int]) -> str:
    """Which stage's range changed, e.g. 'stage 0 [0, 3) -> [0, 2), stage 1 [3, 6) -> [2, 6)'."""
    parts = []
    for stage, (a, b) in enumerate(zip(old, new)):
        a_start, b_start = sum(old[:stage]), sum(new[:stage])
        if (a_start, a) != (b_start, b):
            parts.append(f"stage {stage} [{a_start}, {a_start + a}) -> [{b_start}, {b_start + b})")
    return ", ".join(parts)
