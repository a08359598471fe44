"""Recovery from a failed stage: the fault events, the restart budget (a rate) and the choice
between a stage-local KV rebuild and a full recompute.

A failed stage (StageFailedError) is replaced, up to `max_stage_restarts` replacements within
VLLM_STAGE_RESTART_WINDOW_S; past that the engine aborts everything, releases its workers and
raises EngineDeadError. Then its KV comes back one of two ways:
- **local** (`stage_recovery="local"`, PP > 1, restarts allowed: the stages keep boundary
  caches): the steps in flight are lost, so their groups roll back to their committed state
  keeping their blocks (`vllm.core.stage_rollback`); only the replaced stages re-prefill the
  committed tokens, in chunks (`vllm.engine.stage_replay`), from the token ids (first stage)
  or the previous stage's boundary cache, while every other stage keeps its KV and swap
  copies. Work: tokens x stages rebuilt.
- **full**: every unfinished request goes back to the waiting queue and re-prefills all its
  tokens through all stages. Work: tokens x pipeline_parallel_size. Also the fallback for a
  group the local path cannot trust (said in the log) and when a replay step fails.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.core.stage_rollback import (
    RollbackPlan,
    end_swap_round,
    log_rollback,
    next_swap_round,
    requeue_after_replay,
    roll_back_for_replay,
)
from vllm.engine.stage_replay import replay_steps, replay_tokens
from vllm.executor.stage_supervisor import FaultEvent, StageFailedError
from vllm.logger import init_logger
from vllm.step_delta import BlockOps, ReplayRequest

if TYPE_CHECKING:
    from vllm.engine.llm_engine import LLMEngine

logger = init_logger("vllm.engine.recovery")


class StageRecovery:
    """Owns the engine's fault events, its restart window and how each failure is
    recovered (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # Stage failures seen, each with its detection and recovery times and work figures.
        self.events: list[FaultEvent] = []
        # When each counted stage replacement happened (time.monotonic()), for the rate limit.
        self.restart_times: list[float] = []
        # The failure whose stages are being replaced right now (read by `health`).
        self.recovering: StageFailedError | None = None
        # The last fault whose requests are not all back yet, and what each of its sequences
        # must have computed again to be (`after_step`).
        self._catching_up: tuple[FaultEvent, dict[int, int]] | None = None

    def restarts_in_window(self) -> int:
        """Stage replacements counted against max_stage_restarts now (the budget is a rate)."""
        window = envs.get_float("VLLM_STAGE_RESTART_WINDOW_S")
        now = time.monotonic()
        return sum(1 for t in self.restart_times if now - t < window)

    def local_rebuild_enabled(self) -> bool:
        """Whether the stages keep boundary caches, so a replaced stage can be rebuilt alone."""
        return self.engine.parallel_config.boundary_cache_enabled

    def recover(self, error: StageFailedError) -> None:
        """Replace the failed stages and bring their KV back (locally or in full); or, when
        restarts are used up or replacing fails, abort everything, release the workers and
        raise EngineDeadError."""
        self.recovering = error
        try:
            self._replace_and_rebuild(error)
        finally:
            self.recovering = None

    def _replace_and_rebuild(self, error: StageFailedError) -> None:
        engine = self.engine
        sched = engine.scheduler
        pp = engine.parallel_config.pipeline_parallel_size
        event = FaultEvent(error.ranks, str(error), error.detected_after_s)
        event.signature = error.raised_signature
        event.step_request_ids = engine.batch_queue.request_ids_of_call(error.call_id)
        previous = self.events[-1] if self.events else None
        self.events.append(event)
        # What a full recompute of this state costs: every token whose KV was computed (the
        # steps in flight never committed theirs: they run again on any path), every stage.
        committed = _committed_tokens([*sched.running, *sched.swapped])
        # Caught up once every sequence has the KV it had back.
        self._catching_up = (event, {seq: n for seq, n in committed.items() if n > 0})
        unsent = engine.batch_queue.unsent_block_ops()
        engine.batch_queue.reset()
        full_tokens = sum(committed.values())
        event.extra["full_path_token_stages"] = full_tokens * pp
        plan: RollbackPlan | None = None
        if self.local_rebuild_enabled():
            plan = roll_back_for_replay(sched)
            event.requeued_requests = len(plan.replayed) + len(plan.recomputed)
        else:
            event.requeued_requests = len(sched.requeue_all())
        if (
            previous is not None
            and previous.recovery_s is not None
            and event.signature is not None
            and event.signature == previous.signature
        ):
            self._fail_recurring(event, previous, error)
        if not can_replace_stages(engine.executor):
            # Said before any "Replacing..." line: the in-process backend cannot replace one.
            engine._fail(error, f"the {type(engine.executor).__name__} cannot replace a stage")
        limit = engine.parallel_config.max_stage_restarts
        window = envs.get_float("VLLM_STAGE_RESTART_WINDOW_S")
        now = time.monotonic()
        self.restart_times = [t for t in self.restart_times if now - t < window]
        restarts = len(self.restart_times)
        if restarts >= limit and not event.recurring:
            engine._fail(error, f"max_stage_restarts={limit} restarts within {window:g} s used up")
        logger.warning(
            "Replacing failed stage(s) %s (%s); %d requests will be %s",
            error.ranks,
            "not counted as a restart" if event.recurring else f"restart {restarts + 1} of {limit}",
            event.requeued_requests - len(event.extra.get("failed_requests", [])),
            "rebuilt stage-locally (only the replaced stages re-prefill their tokens)"
            if plan is not None
            else "recomputed with the tokens they have",
        )
        if not event.recurring:
            self.restart_times.append(now)
        try:
            event.recovery_s = engine.executor.replace_stages(error.ranks)
            engine.loras.resync()  # the new stage processes load the registered adapters
        except Exception as exc:
            logger.error("Replacing stage(s) %s failed: %s", error.ranks, exc)
            why = f"replacing the stage failed ({type(exc).__name__}: {exc})"
            if not engine.elastic.can_shrink(error):
                engine._fail(error, why)
            self._shrink_instead(error, event, why, plan, committed, unsent)
            return
        assert event.recovery_s is not None
        tp = engine.parallel_config.tensor_parallel_size
        stages = sorted({rank // tp for rank in error.ranks})
        if plan is not None:
            replay_started = time.perf_counter()
            self._rebuild(plan, stages, event, committed, unsent)
            event.extra["replay_s"] = time.perf_counter() - replay_started
            event.recovery_s += event.extra["replay_s"]
        else:
            # Every request that held KV re-prefills all the tokens it has (prompt + output).
            event.extra["stage_recovery"] = "full"
            event.extra["recomputed_tokens"] = full_tokens
            event.extra["recomputed_token_stages"] = full_tokens * pp
        logger.info(
            "Pipeline serving again %.1f s after the failure was detected (detection took "
            "%.1f s; %s recovery: %d token-stages recomputed, a full recompute: %d)",
            event.recovery_s,
            event.detected_after_s,
            event.extra["stage_recovery"],
            event.extra["recomputed_token_stages"],
            event.extra["full_path_token_stages"],
        )
        if engine.stats is not None:
            engine.stats.log_fault(event, event.extra["recomputed_tokens"])

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
        groups = [*sched.waiting, *sched.running, *sched.swapped]
        for group in groups:
            for seq in group.get_unfinished_seqs():
                if seq.data.get_num_computed_tokens() < targets.get(seq.seq_id, 0):
                    return
        event.extra["caught_up_s"] = time.time() - event.detected_at
        self._catching_up = None
        if self.engine.executor is not None:
            self.engine.executor.refill_spares()  # for the next failure, now the CPU is free
        logger.info(
            "Every request is back where it was %.2f s after the failure was detected (%s "
            "recovery, %d sequences)",
            event.extra["caught_up_s"], event.extra.get("stage_recovery"), len(targets),
        )  # fmt: skip

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
        (`vllm.engine.elastic`: with `plan`, rebuilding only the lost layers' KV where it
        can), or the engine ends when even that fails."""
        engine = self.engine
        try:
            engine.elastic.shrink(error, event, why, plan, committed, unsent)
        except Exception as exc:
            logger.error("Going on without stage(s) %s failed: %s", error.ranks, exc)
            engine._fail(error, f"{why}, and so did going on without it ({exc})")
        if engine.stats is not None:
            engine.stats.log_fault(event, event.extra["recomputed_tokens"])

    def _rebuild(
        self,
        plan: RollbackPlan,
        stages: list[int],
        event: FaultEvent,
        committed_at_fault: dict[int, int],
        unsent: list[BlockOps],
    ) -> None:
        """Replay the kept groups' committed tokens through the replaced `stages`; a failed
        replay step falls back to a full recompute. `committed_at_fault`: each sequence's
        tokens with KV at the failure (what recomputing it in full computes again);
        `unsent`: block operations of steps no rank got, applied first."""
        engine = self.engine
        sched = engine.scheduler
        pp = engine.parallel_config.pipeline_parallel_size
        groups = [g for g in plan.replayed if not g.is_finished()]
        steps = replay_steps(groups, sched.block_manager, sched.budget.max_num_batched_tokens)
        replayed = replay_tokens(steps)
        logger.info(
            "Stage-local rebuild of stage(s) %s: %d requests, %d tokens in %d replay step(s) "
            "(%d swapped requests swapped in with it, block operations of %d unsent step(s) "
            "applied first); %d swapped requests rebuilt in rounds; %d requests recomputed in "
            "full",
            stages, len(groups), replayed, len(steps), len(plan.swapped_in), len(unsent),
            len(plan.swap_rounds), len(plan.recomputed),
        )  # fmt: skip
        try:
            for index, step in enumerate(steps or [[]]):
                first = index == 0
                before = [*unsent, BlockOps(swap_in=plan.blocks_to_swap_in)] if first else []
                self._replay(ReplayRequest(stages, step, sched.kv_blocks_bound(), before))
            replayed += self._rebuild_swapped_in_rounds(plan, stages)
            requeue_after_replay(sched, plan)
        except Exception as exc:
            logger.error(
                "Stage-local rebuild failed (%s: %s); recomputing every request in full",
                type(exc).__name__,
                exc,
            )
            full = sum(
                committed_at_fault.get(seq.seq_id, 0)
                for g in [*sched.running, *sched.swapped, *sched.waiting]
                for seq in g.get_unfinished_seqs()
            )
            sched.requeue_all()
            event.extra["stage_recovery"] = "full (the replay failed)"
            event.extra["replayed_tokens"] = 0
            event.extra["recomputed_tokens"] = full
            event.extra["recomputed_token_stages"] = full * pp
            return
        log_rollback(plan)
        requeued = [g for g in sched.waiting if g.request_id in plan.recomputed]
        # A prompt that was in flight had no KV yet: it runs again, but computes nothing again.
        recomputed_full = sum(
            committed_at_fault.get(seq.seq_id, 0)
            for g in requeued
            for seq in g.get_unfinished_seqs()
        )
        event.extra["stage_recovery"] = "local"
        event.extra["rebuilt_stages"] = stages
        event.extra["replayed_tokens"] = replayed
        event.extra["swap_rounds_requests"] = len(plan.swap_rounds)
        event.extra["recomputed_requests"] = dict(plan.recomputed)
        event.extra["recomputed_tokens"] = replayed + recomputed_full
        event.extra["recomputed_token_stages"] = replayed * len(stages) + recomputed_full * pp

    def _replay(self, request: ReplayRequest) -> None:
        """Run one replay step on every rank, within the deadline of a step of its tokens."""
        engine = self.engine
        num_tokens = sum(meta.token_chunk_size or 0 for meta in request.groups)
        engine.executor.replay(request, engine.parallel_config.step_deadline_s(num_tokens))

    def _rebuild_swapped_in_rounds(self, plan: RollbackPlan, stages: list[int]) -> int:
        """Swapped groups with no room to come back now, one round each: swapped in (running
        groups lending their blocks if needed), their committed tokens replayed on the
        replaced `stages`, swapped out again (the replaced stage's host copy of them was
        garbage). One that cannot get the blocks even so is recomputed in full. Returns the
        tokens replayed."""
        sched = self.engine.scheduler
        bm = sched.block_manager
        max_tokens = sched.budget.max_num_batched_tokens
        replayed = 0
        for group in plan.swap_rounds:
            if group.is_finished():
                continue
            swap_round = next_swap_round(sched, group, plan.replayed)
            if swap_round is None:
                plan.recomputed[group.request_id] = (
                    "swapped, and no room to swap it in for the replay even with running "
                    "requests swapped out meanwhile"
                )
                sched.requeue([group])
                continue
            steps = replay_steps([group], bm, max_tokens) or [[]]
            after = end_swap_round(sched, swap_round)
            # Every block the round hands out (the lent groups' new ones too) is below it.
            sched.refresh_kv_blocks_bound()
            bound = sched.kv_blocks_bound()
            for index, step in enumerate(steps):
                self._replay(
                    ReplayRequest(
                        stages,
                        step,
                        bound,
                        swap_round.before if index == 0 else [],
                        after if index == len(steps) - 1 else [],
                    )
                )
            replayed += replay_tokens(steps)
        return replayed

    def _fail_recurring(
        self, event: FaultEvent, previous: FaultEvent, error: StageFailedError
    ) -> None:
        """A replaced stage raised the same error on a step of the same requests: replaying
        them would only fail again. Those requests end (aborted, the stage's error logged) and
        this replacement is not counted against max_stage_restarts; the others go on."""
        poisoned = [r for r in event.step_request_ids if r in set(previous.step_request_ids)]
        if not poisoned:
            return
        event.recurring = True
        event.extra["failed_requests"] = poisoned
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
        self.engine._end_as_failed(
            [g for q in queues for g in q if g.request_id in wanted],
            f"its step failed the same way again after a stage replacement: {error}",
        )


def _committed_tokens(groups: Any) -> dict[int, int]:
    """Per unfinished sequence of `groups`: the tokens whose KV it has (its committed
    computed tokens; a step's output advances them only once it is collected)."""
    return {
        seq.seq_id: seq.data.get_num_computed_tokens()
        for g in groups
        for seq in g.get_unfinished_seqs()
    }


def can_replace_stages(executor: Any) -> bool:
    """Whether `executor` can replace a failed stage (the in-process one cannot)."""
    from vllm.executor.base import ExecutorBase

    replace = getattr(executor, "replace_stages", None)
    return replace is not None and getattr(replace, "__func__", replace) is not (
        ExecutorBase.replace_stages
    )
