"""What the engine reports of its stages' failures and of every change of the pipeline: typed
records, read by the log lines, the metrics (`vllm.engine.metrics`), the server's admin route,
masstest and the tests. Imports no torch.

- `FaultEvent`: one stage failure, its detection and recovery times, and the work its
  recovery did again (in token-stages: a token through one stage's layers).
- `PipelineResizeEvent`: one shrink or grow (the pipeline's size changed).
- `ReshapeEvent`: one reshape (the layers moved between the same stages).
- `EngineHealth`: what `/health` says of a live engine.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

# How a fault's KV came back (`FaultEvent.stage_recovery`).
LOCAL = "local"  # the replaced stages alone replayed the committed tokens
FULL = "full"  # every request re-prefilled through every stage
FULL_AFTER_FAILED_REPLAY = "full (the replay failed)"
SHRINK = "shrink"  # the pipeline went on without the stage; every request recomputed
SHRINK_LOCAL = "shrink (local)"  # a neighbour took the layers and replayed only those


@dataclass
class FaultEvent:
    """One stage failure the engine survived (or not)."""

    ranks: list[int]
    message: str
    detected_after_s: float
    # From detection until the pipeline serves again (the replay included); None: it did not.
    recovery_s: float | None = None
    requeued_requests: int = 0
    # When the engine learned of the failure (time.time()).
    detected_at: float = field(default_factory=time.time)
    # What StageFailedError.raised_signature said, and the requests of the step that failed.
    signature: tuple[tuple[int, str], ...] | None = None
    step_request_ids: list[str] = field(default_factory=list)
    # The same failure again on the same requests after a replacement: those requests were
    # failed instead of replayed (`failed_requests`), and the replacement was not counted as
    # a restart.
    recurring: bool = False
    failed_requests: list[str] = field(default_factory=list)
    # How the KV came back: one of LOCAL, FULL, FULL_AFTER_FAILED_REPLAY, SHRINK, SHRINK_LOCAL
    # (None until the recovery got that far).
    stage_recovery: str | None = None
    # The work: a full recompute of the state at the failure (committed tokens x PP), and
    # what the recovery did (replayed tokens x stages rebuilt + tokens recomputed in full x
    # PP), in token-stages of the pipeline at the failure.
    full_path_token_stages: int = 0
    recomputed_tokens: int = 0
    recomputed_token_stages: int = 0
    replayed_tokens: int = 0
    replay_s: float = 0.0
    # Local rebuild: the stages replaced and rebuilt, the swapped requests rebuilt one round
    # each, and the requests recomputed in full instead (request id -> why).
    rebuilt_stages: list[int] = field(default_factory=list)
    swap_rounds_requests: int = 0
    recomputed_requests: dict[str, str] = field(default_factory=dict)
    # Shrink: the pipeline after it, and (local) the stage that took the lost layers and the
    # swapped requests swapped in for the replay.
    pipeline_parallel_size: int | None = None
    layer_split: list[int] | None = None
    merged_into: int | None = None
    swapped_in_requests: int = 0
    # Seconds from detection until every sequence that had KV has it back (None: not yet, or
    # another fault came first).
    caught_up_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PipelineResizeEvent:
    """One change of the pipeline's size: why, the stages and layers before and after."""

    reason: str  # "shrink" (a stage could not be replaced) or "grow"
    old_pp: int
    new_pp: int
    old_split: list[int]
    new_split: list[int]
    seconds: float = 0.0
    recomputed_requests: int = 0
    num_gpu_blocks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ReshapeEvent:
    """One reshape: the layers per stage before and after, why, and what it cost."""

    old_split: list[int]
    new_split: list[int]
    reason: str  # "request" (a caller asked) or "auto" (measured step times: a rebalance)
    seconds: float = 0.0
    num_gpu_blocks: int = 0
    recomputed_requests: int = 0
    # Auto: each stage's mean compute seconds per step that led to it, and the step time
    # (the slowest stage's) measured and predicted for the new split.
    stage_step_s: list[float] = field(default_factory=list)
    measured_step_s: float | None = None
    predicted_step_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class EngineHealth:
    """What `/health` reports of a live engine: "healthy", or "degraded" while a failed stage
    is being replaced (or was found failed and will be at the next step) or the pipeline runs
    with fewer stages than configured -- requests are accepted and finish. A dead engine
    raises instead (503)."""

    status: str = "healthy"
    message: str = ""
    ranks: list[int] = field(default_factory=list)

    @property
    def degraded(self) -> bool:
        return self.status == "degraded"
