"""An executor whose pipeline changes size while it serves: whole stages leave when a failed
one cannot be replaced (PP N -> N-1) and come back later (the engine's side:
`vllm.resilience.plans.shrink` and `.grow`).

Leaving (`remove_stages`): the failed stage's ranks are stopped, the survivors are renumbered
in stage order (`vllm.distributed.pipeline_resize`), re-form the process groups at the smaller
size (a new rendezvous), take an even split of the layers over the stages left (each loads
only the layers it gains: `Worker.reshape`) and re-size their KV caches. Or, with `merge`, ONE
neighbour takes the lost stage's layers (`merged_split`) and every other survivor keeps its
range, KV and all: the neighbour loads only those layers (`Worker.merge_layers`) and says how
many blocks it can hold; the engine then grows its cache (`grow_merged_cache`), replays the
gained layers' KV (`replay_gained_layers`) and ends it (`finish_merge`), or takes the even
split after all (`split_evenly`).

Coming back, in two calls so the engine touches its requests only once the new processes run:
`start_stages` starts the new stages' ranks (appended as the last stages) up to a built
Worker, without touching the pipeline -- on failure they are stopped again and nothing has
changed; `join_stages` then re-forms the groups with the survivors at the grown size and
restores the configured split (survivors reload, new ranks load their layers), caches
re-sized.

Every change publishes the pipeline's new `PipelineShape` (size, split, block counts) before
the ranks are told: they get the shape with the call that changes them (no config is written).

The backend says how a rank's process is stopped, started and renumbered (`_stop_ranks`,
`_start_processes`, `_renumber_processes`), how its Worker is built (`_init_worker_calls`) and
where the ranks meet (`_regroup_init_method`).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass

from vllm import envs
from vllm.distributed.pipeline_resize import (
    PipelineResize,
    merged_split,
    with_stages,
    without_stages,
)
from vllm.distributed.pipeline_shape import PipelineShape, split_layers
from vllm.distributed.rank_verbs import Verb
from vllm.executor.base import StageProcessExecutor
from vllm.executor.rank_calls import Calls
from vllm.executor.stage_control import MergedStage, StageControl
from vllm.logger import init_logger
from vllm.step_records import ExecuteModelRequest
from vllm.worker.stage_report import StageInfo

logger = init_logger("vllm.executor.elastic")


@dataclass(frozen=True)
class _StartedStages:
    """Stages started by `start_stages`, waiting for `join_stages`."""

    plan: PipelineResize
    init_method: str
    shape: PipelineShape  # the pipeline once they join (split as configured)


class ElasticStageExecutor(StageProcessExecutor, StageControl):
    """A stage-process executor whose pipeline can lose stages and get them back (see the
    module docstring): the `StageControl` of the `mp` and `ray` backends."""

    _started: _StartedStages | None = None
    # Set by `remove_stages(merge=True)` until `finish_merge` / `split_evenly`.
    _merged: MergedStage | None = None

    @property
    def merged(self) -> MergedStage | None:
        return self._merged

    def replay(self, request: ExecuteModelRequest, timeout_s: float) -> None:
        self._run_workers_within(Verb.REPLAY_STAGES, timeout_s, request)

    @abstractmethod
    def _stop_ranks(self, ranks: list[int]) -> None:
        """Stop the processes of `ranks` for good (a frozen one too) and detach them from the
        calls and the watch."""

    @abstractmethod
    def _start_processes(self, ranks: list[int], budget: float) -> None:
        """Start a process for each of `ranks` (slots made by `_renumber`) and attach it to
        the calls and the watch, within `budget` s (a process that cannot be started or
        placed in time raises)."""

    @abstractmethod
    def _init_worker_calls(
        self, ranks: list[int], init_method: str, shape: PipelineShape | None = None
    ) -> Calls:
        """The calls that build the Workers of `ranks` for a pipeline of `shape` (the
        current one when None) with rendezvous `init_method`."""

    def _regroup_init_method(self, timeout: float) -> str:
        """A rendezvous for the next formation of the groups (every rank on this node: a
        private FileStore)."""
        return self._local_init_method()

    @abstractmethod
    def _renumber_processes(self, order: list[int | None]) -> None:
        """The backend's per-rank records follow `order` (see `RankCalls.renumber`)."""

    def _renumber(self, order: list[int | None]) -> None:
        """Every per-rank record follows `order`: new rank i is old rank order[i] (None: a
        slot for a new rank)."""
        tp = self.parallel_config.tensor_parallel_size
        self.calls.renumber(order)
        self.watch.renumber(order)
        infos = []
        for new, old in enumerate(order):
            info = StageInfo(new, new // tp, new % tp) if old is None else self.stage_infos[old]
            info.rank, info.pp_rank, info.tp_rank = new, new // tp, new % tp
            infos.append(info)
        self.stage_infos = infos
        self._renumber_processes(order)

    def _regroup(self, plan: PipelineResize, init_method: str, budget: float) -> None:
        """The groups re-formed at `plan.new_pp` stages (the published `shape`): survivors
        rejoin under their new number while new ranks join for the first time (the
        rendezvous needs every rank at once: all calls are sent, then waited on).

        The wait is `budget` plus the groups' timeout: a survivor may first sit out an
        earlier rendezvous whose new rank died in it (a replacement that failed there), which
        ends only at that timeout -- it can be longer than `budget` with a large
        max_num_batched_tokens, and then a pipeline that could go on would end."""
        calls: dict[int, tuple[Verb, tuple, dict]] = {
            new: (
                Verb.REJOIN_PROCESS_GROUPS,
                (init_method,),
                {"rank": new, "shape": self.shape},
            )
            for new in plan.staying
        }
        calls.update({new: (Verb.INIT_DEVICE, (), {}) for new in plan.joining})
        tokens = self.scheduler_config.max_num_batched_tokens
        wait = budget + self.parallel_config.comm_timeout_s(tokens)
        self._wait_calls(list(calls), self._submit(calls), wait)

    # ---- stages leave ------------------------------------------------------------------------

    def remove_stages(self, ranks: list[int], merge: bool = False) -> float:
        """The stages holding `ranks` leave the pipeline with all their TP ranks; the others
        go on with an even split of the layers, or with `merge` (one stage lost) a neighbour
        takes its layers and `merged` says which and how many blocks it can hold (see the
        module docstring). Returns the seconds it took. The pipeline must be empty; the
        engine recomputes every request, or with `merge` rebuilds the gained layers' KV."""
        started = time.monotonic()
        shape = self.shape
        plan = without_stages(shape.pipeline_parallel_size, shape.tensor_parallel_size, ranks)
        old_sizes = list(shape.layer_split)
        lost_stages = sorted({r // plan.tp for r in plan.leaving})
        if merge and len(lost_stages) != 1:
            raise ValueError(f"merge takes one lost stage, got stages {lost_stages}.")
        budget = envs.get_float("VLLM_PP_STAGE_RESTART_TIMEOUT_S")
        self.watch.arm(armed=False)  # set-up: no heartbeat timeout until it is over
        self._stop_ranks(plan.leaving)
        # The survivors still run (and fail) the steps sent before: nobody wants those.
        self.calls.forget()
        self._renumber(plan.order)
        if merge:
            sizes, _ = merged_split(old_sizes, lost_stages[0])
            partition = ",".join(str(n) for n in sizes)
            self._publish(shape.resized(plan.new_pp, sizes, partition))
        else:
            self._publish(self._evenly_split(plan.new_pp))
        self._regroup(plan, self._regroup_init_method(budget), budget)
        if merge:
            self._merge_lost_stage(plan, old_sizes)
        else:
            self.split_evenly()
        return time.monotonic() - started

    def _evenly_split(self, pipeline_parallel_size: int) -> PipelineShape:
        split = split_layers(self.model_config, pipeline_parallel_size, None)
        return self.shape.resized(pipeline_parallel_size, split, None)

    def split_evenly(self) -> None:
        """Every stage takes its range under an even split of the layers, caches re-made at
        the new minimum (the engine recomputes every request)."""
        self._merged = None
        self._publish(self._evenly_split(self.shape.pipeline_parallel_size))
        self.reshape_pipeline(list(self.shape.layer_split))

    def _merge_lost_stage(self, plan: PipelineResize, old_sizes: list[int]) -> None:
        """A neighbour of the lost stage takes its layers (the published split); the others
        keep theirs."""
        lost = sorted({r // plan.tp for r in plan.leaving})[0]
        sizes, stage = merged_split(old_sizes, lost)
        start = sum(old_sizes[:lost])
        lost_layout = (start, start + old_sizes[lost], lost == 0, lost == plan.old_pp - 1)
        # Loading layers is set-up: it may hold a rank's GIL for a while outside any step.
        with self._heartbeat_timeout_lifted():
            blocks = self._run_workers(Verb.MERGE_LAYERS, self.shape, lost_layout)
        self._refresh_stage_infos()
        taken = [b for b in blocks if b is not None]
        first = sum(sizes[:stage])
        self._merged = MergedStage(
            stage, lost, (lost_layout[0], lost_layout[1]), (first, first + sizes[stage]),
            min(b[0] for b in taken), min(b[1] for b in taken),
        )  # fmt: skip

    def _merged_ranks(self) -> list[int]:
        merged = self._merged
        if merged is None:
            raise RuntimeError("no merged stage: remove_stages(merge=True) first")
        tp = self.shape.tensor_parallel_size
        return [merged.stage * tp + i for i in range(tp)]

    def grow_merged_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The merged stage's cache gets the gained layers, every tensor at these counts
        (at most the engine's): the engine's block counts from now on."""
        with self._heartbeat_timeout_lifted():
            self._call_ranks(
                self._merged_ranks(), Verb.GROW_MERGED_CACHE, num_gpu_blocks, num_cpu_blocks
            )
        self._publish(self.shape.with_blocks(num_gpu_blocks, num_cpu_blocks))

    def replay_gained_layers(self, request: ExecuteModelRequest, timeout_s: float) -> None:
        """One replay step of the merged stage's gained layers (every rank applies the
        swap-ins), within `timeout_s`; StageFailedError when a rank fails it."""
        self._run_workers_within(Verb.REPLAY_GAINED_LAYERS, timeout_s, request)

    def finish_merge(self) -> None:
        """The gained layers have their KV (or the engine recomputes everything)."""
        self._call_ranks(self._merged_ranks(), Verb.FINISH_MERGE)
        self._merged = None

    # ---- stages come back --------------------------------------------------------------------

    def start_stages(self, num_stages: int, layer_partition: str | None) -> list[int]:
        """Start the ranks of `num_stages` more stages (the last ones of a pipeline split as
        `layer_partition`) up to a built Worker; the pipeline is untouched. Returns their
        ranks. On failure (a process that cannot be started, or dies, or the restart
        deadline passes) they are stopped and the executor is as before; the error is
        raised."""
        shape = self.shape
        plan = with_stages(shape.pipeline_parallel_size, shape.tensor_parallel_size, num_stages)
        budget = envs.get_float("VLLM_PP_STAGE_RESTART_TIMEOUT_S")
        split = split_layers(self.model_config, plan.new_pp, layer_partition)
        grown = shape.resized(plan.new_pp, split, layer_partition)
        self._renumber(plan.order)
        try:
            self._start_processes(plan.joining, budget)
            # Known once they run (on Ray: on which node).
            init_method = self._regroup_init_method(budget)
            calls = self._init_worker_calls(plan.joining, init_method, grown)
            self._wait_calls(plan.joining, self._submit(calls), budget)
        except BaseException:
            self._stop_ranks(plan.joining)
            self._renumber(list(range(shape.world_size)))
            raise
        self._started = _StartedStages(plan, init_method, grown)
        return plan.joining

    def join_stages(self) -> float:
        """The stages `start_stages` started join: the groups re-formed at the grown size,
        the layers split as its `layer_partition` (survivors load what they gain, new ranks
        their range), every cache re-sized. Returns the seconds it took. The pipeline must be
        empty and the engine recomputes every request. On failure the pipeline is left at the
        grown size (the engine removes the new stages again)."""
        started = time.monotonic()
        started_stages, self._started = self._started, None
        if started_stages is None:
            raise RuntimeError("join_stages: no stages started (start_stages first)")
        plan, init_method = started_stages.plan, started_stages.init_method
        grown = started_stages.shape
        budget = envs.get_float("VLLM_PP_STAGE_RESTART_TIMEOUT_S")
        self.watch.arm(armed=False)
        self.calls.forget()
        # The block counts stay until the caches are re-sized below.
        self._publish(self.shape.resized(plan.new_pp, grown.layer_split, grown.layer_partition))
        self._regroup(plan, init_method, budget)
        self._call_ranks(plan.joining, Verb.LOAD_MODEL, timeout=budget)
        self.reshape_pipeline(list(grown.layer_split))
        # As configured ("auto" stays "auto"), for the next time a stage is lost.
        self._publish(self.shape.with_partition(grown.layer_partition))
        return time.monotonic() - started
