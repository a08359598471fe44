"""What a stage reports about itself: where it runs (`StageInfo`) and where its time went
(`StageStats`, accumulated by `StageTimers`). Torch-free: the engine, the executors, the
supervisor and the benchmarks read these records (`LLMEngine.get_stage_infos`,
`LLMEngine.get_stage_stats`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class StageInfo:
    """One rank: which stage and layers, where it runs, what it holds.

    The executor creates it when it starts the rank, with what it knows then (rank, stage,
    TP rank; the pid or Ray node once the process exists); the rank fills in the rest when it
    is up (`Worker.get_stage_info`, merged by `update_from`)."""

    rank: int
    pp_rank: int
    tp_rank: int = 0
    tp_size: int = 1
    layers: tuple[int, int] | None = None
    is_first: bool = False
    is_last: bool = False
    host: str | None = None
    ip: str = ""
    pid: int | None = None
    node_id: str = ""  # the Ray node of the rank's actor ("" off Ray)
    device: str = ""
    threads: int = 0
    num_params: int = 0
    weight_bytes: int = 0
    linear_path: str = ""

    def update_from(self, reported: StageInfo) -> None:
        """Take what the rank reported, keeping what only the executor knows (its node)."""
        for f in dataclasses.fields(self):
            if f.name != "node_id":
                setattr(self, f.name, getattr(reported, f.name))

    def describe(self) -> str:
        """'stage 1 (rank 1, layers [15, 30), node host 10.0.0.2, pid 1234)'; on Ray the
        node also by its Ray id ('node host 10.0.0.2 id 5a8ca0f91a7a'), which tells apart
        nodes that share a host (Ray's simulated clusters, containers)."""
        start, end = self.layers if self.layers is not None else ("?", "?")
        node = f"{self.host or '?'} {self.ip}".rstrip()
        if self.node_id:
            node += f" id {self.node_id[:12]}"
        pid = "?" if self.pid is None else self.pid
        where = f"rank {self.rank}, layers [{start}, {end}), node {node}, pid {pid}"
        return f"stage {self.pp_rank} ({where})"


@dataclass
class StageStats:
    """Seconds one rank spent in each phase of its steps since the last reset: cache
    operations (mapping the cache ahead of use, swaps, copies, applying the step message),
    waiting for the last stage's sampled ids (first stage, asynchronous pipeline), receiving
    from the previous stage, compute (and the CPU time of it: less than the wall time means
    the core was taken by someone else), sending, and idle between steps (waiting for the
    engine's next call). `step_bytes`: the pickled step messages this rank received."""

    pp_rank: int = 0
    steps: int = 0
    idle_s: float = 0.0
    cache_s: float = 0.0
    tokens_wait_s: float = 0.0
    recv_s: float = 0.0
    compute_s: float = 0.0
    compute_cpu_s: float = 0.0
    send_s: float = 0.0
    step_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StageTimers:
    """Times the phases of each step into a `StageStats`.

    `begin` starts a step, `lap(phase)` charges the time since the previous mark to a phase,
    `end` closes the step (its end starts the idle time before the next). `busy_since` is read
    by the rank's heartbeat thread, so a stuck step can be told from an idle stage."""

    def __init__(self, pp_rank: int = 0) -> None:
        self.pp_rank = pp_rank
        self.stats = StageStats(pp_rank=pp_rank)
        # perf_counter() when the step in progress started; None between steps.
        self.busy_since: float | None = None
        self._last_exit: float | None = None
        self._mark = 0.0

    def begin(self) -> None:
        now = time.perf_counter()
        self.busy_since = self._mark = now
        if self._last_exit is not None:
            self.stats.idle_s += now - self._last_exit

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        setattr(self.stats, phase, getattr(self.stats, phase) + now - self._mark)
        self._mark = now

    def end(self) -> None:
        self._last_exit = self._mark
        self.stats.steps += 1
        self.busy_since = None

    def abort(self) -> None:
        """The step failed: it is over, and no idle time is counted from it."""
        self.busy_since = None
        self._last_exit = None

    def take(self, reset: bool = True) -> StageStats:
        stats = dataclasses.replace(self.stats, pp_rank=self.pp_rank)
        if reset:
            self.stats = StageStats(pp_rank=self.pp_rank)
            self._last_exit = None
        return stats
