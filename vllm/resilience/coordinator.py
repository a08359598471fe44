"""The one owner of what happens when a stage fails: detect -> roll back -> change the stages
-> replay -> resume, and the restart budget. Start here to follow a failure end to end.

1. **Detect.** The executor's supervisor (`vllm.executor.supervisor`) finds a stage process
   gone, stopped or silent, or a stage raises; the step's wait fails with StageFailedError
   (`vllm.resilience.errors`) and the engine hands it to `RecoveryCoordinator.recover`.
2. **Roll back.** The batches in flight are lost (`EngineControl.abandon_in_flight`). With
   the stages' boundary caches on (`stage_recovery="local"`, PP > 1) the groups roll back to
   their committed state keeping their blocks (`vllm.core.stage_rollback`); else every
   request is re-queued to recompute in full.
3. **Change the stages.** The failed stages are replaced in place from a spare or a new
   process (`executor.replace_stages`), up to `max_stage_restarts` replacements within
   VLLM_STAGE_RESTART_WINDOW_S (a rate: `RestartBudget`). When replacing fails and a stage is
   left, the pipeline shrinks instead (`plans/shrink.py`); later it grows back
   (`plans/grow.py`). When neither works, or the budget is used up, the engine fails-stop
   (EngineDeadError).
4. **Replay.** Only the replaced stages rebuild their KV (`plans/local_rebuild.py`, through
   the one replay driver `vllm.resilience.replay`), or every request recomputes in full
   (`plans/full_recompute.py`).
5. **Resume.** The engine steps again; `after_step` marks the fault caught up once every
   sequence has its KV back, and refills the warm spares.

Everything is recorded in a typed `FaultEvent` (`vllm.resilience.events`). A step that fails
the same way again on the same requests after a replacement ends those requests instead of
replaying them (not counted as a restart). Reshapes (`plans/reshape.py`) are driven from
here too: between steps (the automatic rebalance) or on demand. Imports no torch.
"""

from __future__ import annotations

import time
from typing import Any

from vllm import envs
from vllm.core.stage_rollback import RollbackPlan, roll_back_for_replay
from vllm.logger import init_logger
from vllm.resilience.engine_control import EngineControl
from vllm.resilience.errors import StageFailedError
from vllm.resilience.events import EngineHealth, FaultEvent, ReshapeEvent
from vllm.resilience.plans import full_recompute, grow, local_rebuild, shrink
from vllm.resilience.plans.reshape import PipelineReshaper
from vllm.resilience.replay import committed_tokens
from vllm.resilience.resizes import PipelineResizes
from vllm.step_records import BlockOps

logger = init_logger("vllm.resilience.coordinator")


class RestartBudget:
    """How many stage replacements `max_stage_restarts` allows now: a count within the last
    VLLM_STAGE_RESTART_WINDOW_S, so a long-lived server is not worn out by rare faults."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._times: list[float] = []  # time.monotonic() of each counted replacement

    @staticmethod
    def window_s() -> float:
        return envs.get_float("VLLM_STAGE_RESTART_WINDOW_S")

    def used(self) -> int:
        """Replacements counted against the limit now."""
        now = time.monotonic()
        self._times = [t for t in self._times if now - t < self.window_s()]
        return len(self._times)

    def exhausted(self) -> bool:
        return self.used() >= self.limit

    def spend(self) -> None:
        self._times.append(time.monotonic())


class RecoveryCoordinator:
    """Owns the engine's fault events, its restart budget, the recovery of each failure and
    the pipeline's reshapes and resizes (see the module docstring)."""

    def __init__(self, engine: EngineControl) -> None:
        self.engine = engine
        # Stage failures seen, each with its detection and recovery times and work figures.
        self.events: list[FaultEvent] = []
        self.budget = RestartBudget(engine.parallel_config.max_stage_restarts)
        # The failure whose stages are being replaced right now (read by `health`).
        self.recovering: StageFailedError | None = None
        # The last fault whose requests are not all back yet, and what each of its sequences
        # must have computed again to be (`after_step`).
        self._catching_up: tuple[FaultEvent, dict[int, int]] | None = None
        self.reshaper = PipelineReshaper(engine, self.recover)
        self.resizes = PipelineResizes(engine, self.reshaper)

    # -- between steps -------------------------------------------------------------------------

    def has_work_between_steps(self) -> bool:
        """Whether `between_steps` may change the pipeline (a rebalance or a grow)."""
        return self.reshaper.auto or self.resizes.missing_stages > 0

    def between_steps(self) -> None:
        """An automatic rebalance when due, and growing back when stages are missing."""
        self.reshaper.after_step()
        if self.resizes.grow_due():
            self.grow()

    def after_step(self) -> None:
        """After a step: once every sequence that had KV at the last fault has it back
        (computed again up to the tokens it had, or finished), the fault's `caught_up_s` is
        set: seconds from its detection until then. Where a recovery ends (local: after the
        replay; full: once the re-queued requests re-prefilled), comparable across both. A
        prompt that was in flight, or a preempted request re-prefilling, had no KV: it is not
        waited for (it runs on any path, fault or not). A new fault first leaves the earlier
        one without it."""
        if self._catching_up is None:
            return
        event, targets = self._catching_up
        sched = self.engine.scheduler
        for group in [*sched.waiting, *sched.running, *sched.swapped]:
            for seq in group.get_unfinished_seqs():
                if seq.data.get_num_computed_tokens() < targets.get(seq.seq_id, 0):
                    return
        event.caught_up_s = time.time() - event.detected_at
        self._catching_up = None
        control = self.engine.executor.stage_control
        if control is not None and not self.engine.executor.is_shut_down:
            control.refill_spares()  # for the next failure, now the CPU is free
        logger.info(
            "Every request is back where it was %.2f s after the failure was detected (%s "
            "recovery, %d sequences)",
            event.caught_up_s, event.stage_recovery, len(targets),
        )  # fmt: skip

    # -- on demand -----------------------------------------------------------------------------

    def reshape(self, layer_split: Any) -> ReshapeEvent:
        return self.reshaper.reshape(layer_split)

    def grow(self) -> bool:
        return grow.grow(self.engine, self.resizes)

    def health(self) -> EngineHealth:
        """Degraded while failed stages are being replaced, or found failed with a
        replacement allowed (the next step makes it), or while stages are missing; raises
        StageFailedError when a failed stage cannot be replaced."""
        if self.recovering is not None:
            return EngineHealth(
                "degraded", f"replacing failed stage(s): {self.recovering}", self.recovering.ranks
            )
        try:
            self.engine.executor.check_health()
        except StageFailedError as error:
            if self.engine.executor.stage_control is None or self.budget.exhausted():
                raise
            return EngineHealth("degraded", f"{error} (the next step replaces it)", error.ranks)
        if self.resizes.missing_stages > 0:
            # Serving, with fewer stages than configured (one could not be replaced).
            return EngineHealth("degraded", self.resizes.describe_missing())
        return EngineHealth()

    # -- a stage failed ------------------------------------------------------------------------

    def recover(self, error: StageFailedError) -> None:
        """Replace the failed stages and bring their KV back (locally or in full); shrink
        when replacing fails; or, when restarts are used up or nothing works, abort
        everything, release the workers and raise EngineDeadError."""
        self.recovering = error
        try:
            self._recover(error)
        finally:
            self.recovering = None

    def _recover(self, error: StageFailedError) -> None:
        engine = self.engine
        sched = engine.scheduler
        pp = engine.parallel_config.pipeline_parallel_size
        # 1. detect: what failed, and on which requests.
        event = FaultEvent(error.ranks, str(error), error.detected_after_s)
        event.signature = error.raised_signature
        event.step_request_ids = engine.requests_of_call(error.call_id)
        previous = self.events[-1] if self.events else None
        self.events.append(event)
        # 2. roll back. What a full recompute of this state costs: every token whose KV was
        # computed (the steps in flight never committed theirs: they run again on any path),
        # every stage.
        committed = committed_tokens([*sched.running, *sched.swapped])
        # Caught up once every sequence has the KV it had back.
        self._catching_up = (event, {seq: n for seq, n in committed.items() if n > 0})
        unsent = engine.abandon_in_flight()
        full_tokens = sum(committed.values())
        event.full_path_token_stages = full_tokens * pp
        plan: RollbackPlan | None = None
        if engine.parallel_config.boundary_cache_enabled:
            plan = roll_back_for_replay(sched)
            event.requeued_requests = len(plan.replayed) + len(plan.recomputed)
        else:
            event.requeued_requests = len(sched.requeue_all())
        if previous is not None and _same_failure(event, previous):
            self._fail_recurring(event, previous, error)
        # 3. change the stages, within the budget.
        if engine.executor.stage_control is None:
            # Said before any "Replacing..." line: the in-process backend cannot replace one.
            engine.fail(error, f"the {type(engine.executor).__name__} cannot replace a stage")
        used, limit = self.budget.used(), self.budget.limit
        if used >= limit and not event.recurring:
            engine.fail(
                error,
                f"max_stage_restarts={limit} restarts within {self.budget.window_s():g} s used up",
            )
        logger.warning(
            "Replacing failed stage(s) %s (%s); %d requests will be %s",
            error.ranks,
            "not counted as a restart" if event.recurring else f"restart {used + 1} of {limit}",
            event.requeued_requests - len(event.failed_requests),
            "rebuilt stage-locally (only the replaced stages re-prefill their tokens)"
            if plan is not None
            else "recomputed with the tokens they have",
        )
        if not event.recurring:
            self.budget.spend()
        try:
            control = engine.executor.require_stage_control("replace a stage")
            event.recovery_s = control.replace_stages(error.ranks)
            engine.loras.resync()  # the new stage processes load the registered adapters
        except Exception as exc:
            logger.error("Replacing stage(s) %s failed: %s", error.ranks, exc)
            self._shrink_instead(error, event, f"replacing the stage failed ({_named(exc)})",
                                 plan, committed, unsent)  # fmt: skip
            return
        assert event.recovery_s is not None
        # 4. replay (or recompute in full).
        tp = engine.parallel_config.tensor_parallel_size
        stages = sorted({rank // tp for rank in error.ranks})
        if plan is not None:
            local_rebuild.rebuild(engine, plan, stages, event, committed, unsent)
            event.recovery_s += event.replay_s
        else:
            # Every request that held KV re-prefills all the tokens it has (prompt + output).
            full_recompute.account(event, full_tokens, pp)
        # 5. resume.
        logger.info(
            "Pipeline serving again %.1f s after the failure was detected (detection took "
            "%.1f s; %s recovery: %d token-stages recomputed, a full recompute: %d)",
            event.recovery_s, event.detected_after_s, event.stage_recovery,
            event.recomputed_token_stages, event.full_path_token_stages,
        )  # fmt: skip
        engine.log_fault(event)

    def _shrink_instead(
        self,
        error: StageFailedError,
        event: FaultEvent,
        why: str,
        plan: RollbackPlan | None,
        committed: dict[int, int],
        unsent: list[BlockOps],
    ) -> None:
        """The failed stages could not be replaced: the pipeline goes on without them
        (`plans/shrink.py`), or the engine ends when even that fails or cannot be done."""
        engine = self.engine
        if not shrink.can_shrink(engine, error):
            engine.fail(error, why)
        try:
            shrink.shrink(engine, self.resizes, error, event, why, plan, committed, unsent)
        except Exception as exc:
            logger.error("Going on without stage(s) %s failed: %s", error.ranks, exc)
            engine.fail(error, f"{why}, and so did going on without it ({exc})")
        engine.log_fault(event)

    def _fail_recurring(
        self, event: FaultEvent, previous: FaultEvent, error: StageFailedError
    ) -> None:
        """A replaced stage raised the same error on a step of the same requests: replaying
        them would only fail again. Those requests end (aborted, the stage's error logged) and
        this replacement is not counted against max_stage_restarts; the others go on."""
        earlier = set(previous.step_request_ids)
        poisoned = [r for r in event.step_request_ids if r in earlier]
        if not poisoned:
            return
        event.recurring = True
        event.failed_requests = poisoned
        logger.error(
            "Stage(s) %s failed again the same way on a step of the same request(s) after a "
            "replacement; failing request(s) %s instead of replaying them: %s",
            error.ranks,
            poisoned,
            error,
        )
        wanted = set(poisoned)
        sched = self.engine.scheduler
        queues = (sched.waiting, sched.running, sched.swapped)
        self.engine.end_as_failed(
            [g for q in queues for g in q if g.request_id in wanted],
            f"its step failed the same way again after a stage replacement: {error}",
        )


def _same_failure(event: FaultEvent, previous: FaultEvent) -> bool:
    """The previous fault was recovered and raised the same errors on the same stages."""
    return (
        previous.recovery_s is not None
        and event.signature is not None
        and event.signature == previous.signature
    )


def _named(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
