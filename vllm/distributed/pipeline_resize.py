"""How the ranks are renumbered when whole pipeline stages leave (a failed stage that cannot be
replaced) or come back: the plan both backends and the engine follow. Torch-free.

Ranks stay in the TP x PP grid (`rank = pp_rank * tp_size + tp_rank`): a stage leaves with all
its TP ranks, the survivors keep their order (stage order is kept, so the first stage stays
first) and close up; stages that come back are appended as the last stages.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineResize:
    """A change of the pipeline's size: `order[i]` is the old rank that becomes rank i (None:
    a new rank, started fresh); `leaving` are the old ranks that leave."""

    old_pp: int
    new_pp: int
    tp: int
    order: list[int | None]
    leaving: list[int]

    @property
    def joining(self) -> list[int]:
        """The new ranks that start fresh (their processes must be started)."""
        return [new for new, old in enumerate(self.order) if old is None]

    @property
    def staying(self) -> list[int]:
        """The new ranks of the processes that stay (they rejoin under their new number)."""
        return [new for new, old in enumerate(self.order) if old is not None]


def without_stages(pp: int, tp: int, failed_ranks: list[int]) -> PipelineResize:
    """The stages holding `failed_ranks` leave, all their TP ranks with them. ValueError
    naming `failed_ranks` when one is not a rank of the pipeline, or no stage would be left."""
    world = pp * tp
    if not failed_ranks or any(not 0 <= r < world for r in failed_ranks):
        raise ValueError(f"failed_ranks must be ranks in [0, {world}), got {failed_ranks!r}.")
    stages = {r // tp for r in failed_ranks}
    if len(stages) >= pp:
        raise ValueError(
            f"failed_ranks {sorted(failed_ranks)} cover every stage of the {pp}-stage "
            "pipeline: no stage would be left."
        )
    leaving = [r for r in range(world) if r // tp in stages]
    survivors: list[int | None] = [r for r in range(world) if r // tp not in stages]
    return PipelineResize(pp, pp - len(stages), tp, survivors, leaving)


def with_stages(pp: int, tp: int, num_stages: int) -> PipelineResize:
    """`num_stages` stages come back, appended after the last stage (its TP ranks new)."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages!r}.")
    order: list[int | None] = [*range(pp * tp), *[None] * (num_stages * tp)]
    return PipelineResize(pp, pp + num_stages, tp, order, [])


def stages_of(ranks: list[int], tp: int) -> list[int]:
    """The stages (pp ranks) holding `ranks`, in order."""
    return sorted({r // tp for r in ranks})


def merged_split(sizes: list[int], lost_stage: int) -> tuple[list[int], int]:
    """The layer split after stage `lost_stage` of `sizes` left and ONE neighbour took its
    layers: the previous stage, or for the first stage the next one (which becomes the
    first). Every other stage keeps its range, so its KV stays valid. Returns (the new
    sizes, the new number of the stage that took the layers). ValueError naming
    `lost_stage` when it is not a stage, or the last one left."""
    if len(sizes) < 2 or not 0 <= lost_stage < len(sizes):
        raise ValueError(
            f"lost_stage must be a stage of a pipeline of >= 2 stages, got {lost_stage!r} "
            f"of {len(sizes)}."
        )
    merged = lost_stage - 1 if lost_stage > 0 else 0
    new = [n for stage, n in enumerate(sizes) if stage != lost_stage]
    new[merged] += sizes[lost_stage]
    return new, merged
