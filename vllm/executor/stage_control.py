"""`StageControl`: what the engine may do to the stages of a running pipeline, as one typed
interface an executor has or lacks (`ExecutorBase.stage_control`).

The in-process executor has none: its only stage is the engine's own process. Executors
whose stages run in processes of their own (`mp`, `ray`: `vllm.executor.elastic`) have all of
it: replace a failed stage (and keep warm spares for it), replay the committed tokens through
rebuilt stages, let stages leave (PP N -> N-1: an even split, or one neighbour merging the
lost layers, its cache grown and those layers' KV replayed), and start stages and let them
join again. LoRA adapters are synchronised through the ranks' verbs
(`ExecutorBase.collective_rpc`, `vllm.lora.registry`), which every executor answers.
Torch-free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from vllm.step_records import ExecuteModelRequest


@dataclass(frozen=True)
class MergedStage:
    """The stage that took over a lost stage's layers (`remove_stages` with `merge`)."""

    stage: int  # its number in the smaller pipeline
    lost_stage: int  # the lost stage's number in the old pipeline
    lost_layers: tuple[int, int]  # [start, end) it took over
    layers: tuple[int, int]  # its range now
    # (device, host) blocks it can hold with its new layers, within its own budget.
    num_gpu_blocks: int
    num_cpu_blocks: int


class StageControl(ABC):
    """Changes to the stages of a running pipeline. Every change that alters the pipeline's
    shape (size, split, block counts) publishes a new `PipelineShape` on the executor."""

    # -- a failed stage replaced in place -----------------------------------------------------

    @abstractmethod
    def replace_stages(self, ranks: list[int]) -> float:
        """Replace the failed `ranks` with fresh processes (same layers, caches of the
        engine's size); the seconds it took."""

    @abstractmethod
    def refill_spares(self) -> None:
        """Start the warm spare processes a replacement takes (`VLLM_PP_SPARE_PROCESSES`)
        up to their number."""

    @abstractmethod
    def replay(self, request: ExecuteModelRequest, timeout_s: float) -> None:
        """One replay step of a stage-local KV rebuild on every rank (a step whose
        `StepMessage.replay` says which stages rebuild), within `timeout_s`; StageFailedError
        when a rank fails it."""

    # -- stages leave -------------------------------------------------------------------------

    @abstractmethod
    def remove_stages(self, ranks: list[int], merge: bool = False) -> float:
        """The stages holding `ranks` leave the pipeline; the others take an even split, or
        with `merge` one neighbour takes the lost layers (`merged`). The seconds it took."""

    @property
    @abstractmethod
    def merged(self) -> MergedStage | None:
        """The stage that took a lost stage's layers, from `remove_stages(merge=True)` until
        `finish_merge` or `split_evenly`."""

    @abstractmethod
    def split_evenly(self) -> None:
        """Every stage takes its range under an even split, caches re-made at the new
        minimum (the engine recomputes every request)."""

    @abstractmethod
    def grow_merged_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The merged stage's cache gets the gained layers; every cache at these counts."""

    @abstractmethod
    def replay_gained_layers(self, request: ExecuteModelRequest, timeout_s: float) -> None:
        """One replay step (a step with a `StepMessage.replay`) of the merged stage's gained
        layers, within `timeout_s`."""

    @abstractmethod
    def finish_merge(self) -> None:
        """The gained layers have their KV (or the engine recomputes everything)."""

    # -- stages come back ---------------------------------------------------------------------

    @abstractmethod
    def start_stages(self, num_stages: int, layer_partition: str | None) -> list[int]:
        """Start `num_stages` more stages without touching the pipeline; their ranks."""

    @abstractmethod
    def join_stages(self) -> float:
        """The stages `start_stages` started join the pipeline; the seconds it took."""
