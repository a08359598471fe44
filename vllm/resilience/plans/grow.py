"""Grow: while the pipeline runs with fewer stages than configured (after a shrink), the
missing stages come back, PP N-1 -> N, between steps at most every
VLLM_PP_REGROW_INTERVAL_S, or when asked (`LLMEngine.grow_pipeline`, the server's admin
route): the pipeline is drained, the missing stages' processes are started first
(`executor.start_stages`; a failure logs one line and leaves everything as it was), then the
requests are re-queued and the process groups re-formed at the full size with the split in
effect when the stage was lost (`executor.join_stages`). Greedy and seeded outputs are
unchanged (seeded draws are re-seeded from the tokens generated, as after any recompute).
Imports no torch."""

from __future__ import annotations

import time

from vllm.logger import init_logger
from vllm.resilience.engine_control import EngineControl
from vllm.resilience.errors import StageFailedError
from vllm.resilience.events import PipelineResizeEvent
from vllm.resilience.plans.shrink import can_resize_pipeline
from vllm.resilience.resizes import PipelineResizes, regrow_interval_s

logger = init_logger("vllm.resilience.plans.grow")


def grow(engine: EngineControl, resizes: PipelineResizes) -> bool:
    """Start the missing stages and re-form the pipeline at its configured size with the
    split it had; returns whether it grew. Outputs collected while draining are returned by
    the engine's next step."""
    if resizes.missing_stages <= 0 or not can_resize_pipeline(engine.executor):
        return False
    resizes.postpone_grow()
    engine.drain()
    missing = resizes.missing_stages  # a failure while draining may have shrunk it more
    pc = engine.parallel_config
    old_pp, old_split = pc.pipeline_parallel_size, resizes.reshaper.current_split()
    started = time.monotonic()
    try:
        control = engine.executor.require_stage_control("add a stage")
        ranks = control.start_stages(missing, resizes.restore_partition)
    except Exception as exc:
        logger.warning(
            "Growing the pipeline back to PP=%d failed (%s: %s); going on at PP=%d, next "
            "try in %g s",
            resizes.configured_pp, type(exc).__name__, exc, old_pp, regrow_interval_s(),
        )  # fmt: skip
        return False
    requeued = engine.scheduler.requeue_all()
    engine.abandon_in_flight()  # nothing is in flight: the queue starts again
    try:
        control.join_stages()
    except Exception as exc:
        logger.error(
            "Re-forming the pipeline at PP=%d failed (%s: %s); the new stage(s) leave again",
            resizes.configured_pp, type(exc).__name__, exc,
        )  # fmt: skip
        _remove_again(engine, resizes, ranks, exc)
        return False
    pc = engine.parallel_config  # the pipeline as it runs now (the executor's shape)
    resize = PipelineResizeEvent(
        "grow", old_pp, pc.pipeline_parallel_size, old_split, [], 0.0, len(requeued)
    )
    resizes.after_resize(resize)
    resize.seconds = time.monotonic() - started
    logger.info(
        "Pipeline grown back from PP=%d to PP=%d: layers per stage %s -> %s in %.2f s; "
        "# GPU blocks: %d; %d requests will be recomputed with the tokens they have",
        old_pp, pc.pipeline_parallel_size, old_split, resize.new_split, resize.seconds,
        resize.num_gpu_blocks, resize.recomputed_requests,
    )  # fmt: skip
    return True


def _remove_again(
    engine: EngineControl, resizes: PipelineResizes, ranks: list[int], cause: Exception
) -> None:
    """A grow failed half-way: back to the smaller pipeline, or the engine ends."""
    engine.scheduler.requeue_all()
    engine.abandon_in_flight()
    try:
        engine.executor.require_stage_control("remove a stage").remove_stages(ranks)
    except StageFailedError as error:
        engine.fail(error, f"growing the pipeline failed ({cause}) and so did going back")
    resizes.after_resize(None)
