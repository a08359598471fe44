"""Ray executor: one actor per rank inside a placement group; the engine process is the driver.

Ray places, starts and kills the actors. The engine's calls to them (set-up, every step,
stats, shutdown) go over a TCP connection to each actor (`rank_calls`), and its heartbeats
over another (`vllm.executor.supervisor`, answered by a thread of the actor's process): a step
is sent to every stage without waiting, each stage runs its calls in order, and stages hand hidden
states to each other over torch.distributed, so several submitted steps flow through the
stages like a pipeline. (One Ray actor call per step costs each stage milliseconds between
steps on a busy machine; the connection a fraction of that: docs/PERFORMANCE.md.)

Every wait has a deadline, and the supervisor fails it at once when a stage process is gone
or stopped (on this node) or its heartbeat goes silent (anywhere). A stage that dies, freezes
or raises is named (rank, layers, node, pid) in a StageFailedError; `replace_stages` then
kills it, starts a new actor on the same placement-group bundle, loads its layers and
re-forms the process groups with the survivors. A stage whose new actor cannot be placed (or
started) within VLLM_PP_STAGE_RESTART_TIMEOUT_S leaves the pipeline, its bundles kept for its
return (`vllm.executor.elastic`).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterable, Iterator

import ray
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from vllm import envs
from vllm.distributed.net_utils import get_distributed_init_method
from vllm.distributed.pipeline_shape import PipelineShape
from vllm.distributed.rank_handshake import HandshakeKey
from vllm.distributed.rank_verbs import Verb
from vllm.executor.elastic import ElasticStageExecutor
from vllm.executor.liveness import (
    diagnose,
    kill_local_process,
    local_problems,
    name_failures,
    wait_process_gone,
)
from vllm.executor.rank_calls import (
    Calls,
    RankCallError,
    RankCallTimeout,
    connect_to_rank,
)
from vllm.executor.ray_utils import (
    ACTOR_START_TIMEOUT_S,
    RayWorkerWrapper,
    caller_group_start_error,
    check_tp_groups_on_one_node,
    get_or_create_placement_group,
    group_ranks_by_node,
    init_ray,
    placement_timeout_s,
    wait_bundles_placed,
)
from vllm.logger import init_logger
from vllm.resilience.errors import StageFailedError
from vllm.worker.stage_report import StageInfo

logger = init_logger("vllm.executor.ray_executor")

# Set-up calls (start, load, cache) get this long before the engine gives up on a stage.
_SETUP_TIMEOUT_S = 600.0


def _threads_per_stage() -> int:
    return envs.get_int("VLLM_CPU_THREADS_PER_STAGE") or 1


class RayExecutor(ElasticStageExecutor):
    """Runs each pipeline stage in its own Ray actor (possibly on another node)."""

    def _init_workers(self) -> None:
        world = self.parallel_config.world_size
        self._use_gpu = self.device_config.device == "cuda"
        self._owns_ray = init_ray(world, self._use_gpu)
        # The caller's group when the engine runs inside a Ray task/actor that holds one.
        self.placement_group, self._bundles, self._owns_pg = get_or_create_placement_group(
            world, self._use_gpu
        )
        self.workers: list[Any] = [None] * world
        # Bundles of stages that left the pipeline: reserved, for their return.
        self._spare_bundles: list[int] = []
        tp = self.parallel_config.tensor_parallel_size
        self.stage_infos = [StageInfo(r, r // tp, r % tp) for r in range(world)]
        self._start_calls(world)
        # Proves to each actor that a connection to it comes from this engine: only its
        # public part is sent through Ray (`rank_handshake`).
        self._handshake_key = HandshakeKey()
        # Actors started ahead to replace a failed rank (`refill_spares`).
        self.standby: list[Any] = []
        self._start_actors(range(world))
        self._join(range(world), survivors=[])
        self._run_workers(Verb.LOAD_MODEL)
        self.refill_spares()

    @property
    def node_ids(self) -> list[str]:
        """The Ray node id of each rank's actor, in rank order."""
        return [info.node_id for info in self.stage_infos]

    def _actor_env(self) -> dict[str, str]:
        import vllm

        # Actors import vllm from the same source tree as the driver, installed or not.
        src_root = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
        python_path = os.pathsep.join(p for p in (src_root, os.environ.get("PYTHONPATH")) if p)
        env = {"PYTHONPATH": python_path, "OMP_NUM_THREADS": str(_threads_per_stage())}
        # Every engine setting made through the environment reaches the stages.
        env.update(envs.environment_to_forward())
        return env

    def _start_actors(self, ranks: Iterable[int], timeout: float = _SETUP_TIMEOUT_S) -> None:
        """A new actor for each rank, on that rank's placement-group bundle. A bundle whose
        node left the cluster is re-placed by Ray on a node with room; it gets
        VLLM_PP_PLACEMENT_TIMEOUT (within `timeout`) to be, else this raises then, not after
        `timeout` (no node has room: the stage cannot come back now)."""
        actor_cls = ray.remote(
            num_cpus=0 if self._use_gpu else 1,
            num_gpus=1 if self._use_gpu else 0,
        )(RayWorkerWrapper)
        env = self._actor_env()
        ranks = list(ranks)
        first_start = len(ranks) == len(self.workers) and not any(self.workers)
        deadline = time.monotonic() + timeout
        new_ranks = ranks
        if not first_start:
            placed = self._wait_bundles(ranks, min(placement_timeout_s(), timeout))
            new_ranks = []
            for rank in ranks:
                remaining = max(deadline - time.monotonic(), 0.0)
                standby = self._take_standby(placed[rank], remaining)
                if standby is not None:
                    self.workers[rank] = standby
                    logger.info("Rank %d: the standby Ray actor takes it", rank)
                else:
                    new_ranks.append(rank)
        for rank in new_ranks:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self._bundles[rank],
            )
            self.workers[rank] = actor_cls.options(
                scheduling_strategy=strategy, runtime_env={"env_vars": env}
            ).remote()
        remaining = max(deadline - time.monotonic(), 0.0)
        start_timeout = remaining if self._owns_pg else min(remaining, ACTOR_START_TIMEOUT_S)
        try:
            ips = self._wait_all(
                [self.workers[r].get_node_ip.remote() for r in ranks], start_timeout
            )
        except TimeoutError:
            if self._owns_pg:
                raise
            raise caller_group_start_error(start_timeout) from None
        nodes = self._wait_all([self.workers[r].get_node_id.remote() for r in ranks], timeout)
        if first_start:
            # First start: a stage's TP ranks are consecutive, so keep each node's actors
            # together (rank -> bundle follows, for later replacements on the same bundle).
            order = group_ranks_by_node(nodes)
            self.workers = [self.workers[i] for i in order]
            self._bundles = [self._bundles[i] for i in order]
            ips, nodes = [ips[i] for i in order], [nodes[i] for i in order]
            check_tp_groups_on_one_node(nodes, self.parallel_config.tensor_parallel_size)
        for rank, ip, node in zip(ranks, ips, nodes):
            self.stage_infos[rank].ip, self.stage_infos[rank].node_id = ip, node
            logger.info("Rank %d: Ray actor on node %s (id %s)", rank, ip, node[:12])
        key = self._handshake_key
        addresses = self._wait_all(
            [self.workers[r].open_calls.remote(key.public) for r in ranks], timeout
        )
        for rank, (ip, port, rank_public) in zip(ranks, addresses):
            self.calls.attach(rank, connect_to_rank((ip, port), key, rank_public, timeout))
        beats = self._wait_all(
            [self.workers[r].open_heartbeat.remote(key.public) for r in ranks], timeout
        )
        for rank, (ip, port, rank_public, pid, hostname) in zip(ranks, beats):
            conn = connect_to_rank((ip, port), key, rank_public, timeout)
            self.watch.attach(rank, conn, pid, hostname)

    def refill_spares(self) -> None:
        """Start standby actors up to VLLM_PP_SPARE_PROCESSES: on the driver's node, holding
        no CPU of the placement group (a rank's bundle stays reserved for its own
        replacement), torch imported, no Worker. Not on GPU: a standby would hold a GPU, and
        Ray gives an actor its GPU only when it starts. The engine calls it once a recovery
        has caught up (a standby starting beside a replay would slow it)."""
        wanted = 0 if self._use_gpu else self._spares_wanted()
        if len(self.standby) >= wanted:
            return
        strategy = NodeAffinitySchedulingStrategy(
            node_id=ray.get_runtime_context().get_node_id(), soft=True
        )
        actor_cls = ray.remote(num_cpus=0)(RayWorkerWrapper)
        env = self._actor_env()
        while len(self.standby) < wanted:
            self.standby.append(
                actor_cls.options(
                    scheduling_strategy=strategy, runtime_env={"env_vars": env}
                ).remote()
            )

    def _wait_bundles(self, ranks: list[int], wait_s: float) -> dict[int, str]:
        """The node each rank's bundle is reserved on (a live one, within `wait_s`), or a
        clear error; a rank whose node left the cluster is logged with the node it moves
        to."""
        resource = "GPU" if self._use_gpu else "CPU"
        placed = wait_bundles_placed(
            self.placement_group, {r: self._bundles[r] for r in ranks}, wait_s, resource
        )
        for rank, node in placed.items():
            old = self.stage_infos[rank].node_id
            if old and node != old:
                logger.warning(
                    "Rank %d: its node (id %s) left the Ray cluster; its placement-group "
                    "bundle %d now reserved on node id %s",
                    rank, old[:12], self._bundles[rank], node[:12],
                )  # fmt: skip
        return placed

    def _take_standby(self, node_id: str, timeout: float) -> Any:
        """A standby actor, taken out of the pool, when one is up on `node_id` (where the
        rank's bundle is: the node it ran on, or the one its bundle moved to when that node
        left the cluster; a stage's TP ranks stay on one node); None otherwise, at once when
        that is not the driver's node, where standbys are started. A dead one is dropped."""
        if self.standby and node_id != ray.get_runtime_context().get_node_id():
            return None
        while self.standby:
            actor = self.standby[0]
            try:
                node = ray.get(actor.get_node_id.remote(), timeout=timeout)
            except Exception as exc:  # it died, or never started
                logger.warning("The standby Ray actor is not usable (%s); dropped", exc)
                self.standby.pop(0)
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
                continue
            if node != node_id:
                return None  # another node: a new actor on the rank's own bundle instead
            return self.standby.pop(0)
        return None

    def _join(
        self, ranks: Iterable[int], survivors: list[int], timeout: float = _SETUP_TIMEOUT_S
    ) -> None:
        """Build Workers on the new `ranks` and form the process groups with the survivors
        (who leave their old groups and join the new ones at the same time)."""
        ranks = list(ranks)
        init_method = self._regroup_init_method(timeout)
        self._wait_calls(ranks, self._submit(self._init_worker_calls(ranks, init_method)), timeout)
        # Process-group rendezvous needs every rank at once: send all, then wait.
        calls: dict[int, tuple[Verb, tuple, dict]] = {r: (Verb.INIT_DEVICE, (), {}) for r in ranks}
        calls.update({r: (Verb.REJOIN_PROCESS_GROUPS, (init_method,), {}) for r in survivors})
        self._wait_calls(list(calls), self._submit(calls), timeout)

    def _regroup_init_method(self, timeout: float) -> str:
        driver_node = ray.get_runtime_context().get_node_id()
        if all(info.node_id == driver_node for info in self.stage_infos):
            return self._local_init_method()  # one node: a file, no port
        # Across nodes: a TCP store on rank 0's own address (never all interfaces).
        port = self._wait_all([self.workers[0].get_open_port.remote()], timeout)[0]
        return get_distributed_init_method(self.stage_infos[0].ip, port)

    def _init_worker_calls(
        self, ranks: list[int], init_method: str, shape: PipelineShape | None = None
    ) -> Calls:
        threads = None if self._use_gpu else _threads_per_stage()
        kwargs = dict(
            engine_config=self.engine_config,
            distributed_init_method=init_method,
            num_threads=threads,
            shape=shape or self.shape,
        )
        return {r: (Verb.INIT_WORKER, (), dict(kwargs, rank=r)) for r in ranks}

    # -- an elastic pipeline (vllm.executor.elastic) ------------------------------------------

    def _stop_ranks(self, ranks: list[int]) -> None:
        self._kill_ranks(ranks)

    def _start_processes(self, ranks: list[int], budget: float) -> None:
        # A stage coming back: no wait for a bundle with no node (that node left and none has
        # room yet); the engine tries again later instead of stalling its steps meanwhile.
        self._wait_bundles(ranks, 0.0)
        self._start_actors(ranks, budget)
        self.refill_spares()

    def _renumber_processes(self, order: list[int | None]) -> None:
        # A stage that leaves keeps its bundles reserved; one that comes back takes them (its
        # TP ranks' bundles were on one node).
        kept = {old for old in order if old is not None}
        self._spare_bundles += [b for r, b in enumerate(self._bundles) if r not in kept]
        bundles = []
        for old in order:
            bundles.append(self._spare_bundles.pop(0) if old is None else self._bundles[old])
        self._bundles = bundles
        self.workers = [None if old is None else self.workers[old] for old in order]

    def _call_timeout_s(self) -> float:
        return _SETUP_TIMEOUT_S

    @contextlib.contextmanager
    def _failures_named(self, timeout_problem: str) -> Iterator[None]:
        """A rank's error, loss or missed deadline as a StageFailedError naming the stages."""
        started = time.monotonic()
        try:
            yield
        except RankCallTimeout:
            raise self._stage_failure(None, time.monotonic() - started, timeout_problem) from None
        except RankCallError as err:
            # From the start of the rank's trouble when the supervisor found it, else the wait.
            since = started if err.since is None else err.since
            raise self._stage_failure(err, time.monotonic() - since, None, err.rank) from None

    @staticmethod
    def _wait_all(refs: list[Any], timeout: float = _SETUP_TIMEOUT_S) -> list[Any]:
        """ray.get that fails fast (an error on any rank is raised at once, not after a hang
        of the ranks waiting on it) and never waits past `timeout` seconds."""
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{len(pending)} of {len(refs)} stage calls did not finish within {timeout:g} s"
                )
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if ready:
                ray.get(ready[0])
        return ray.get(refs)

    # -- steps -----------------------------------------------------------------------------

    def _stage_failure(
        self,
        exc: RankCallError | None,
        waited_s: float,
        timeout_problem: str | None,
        raising_rank: int = -1,
    ) -> StageFailedError:
        """Name the failed stages: dead or frozen ones first; else the one that raised; else
        (a missed deadline with every stage alive) the ones stuck in a step."""
        # A stage that raised is the cause; stages busy meanwhile (waiting on it) are not.
        include_stuck = exc is None or exc.lost
        problems = local_problems(self.stage_infos) or diagnose(
            self.stage_infos, self.watch.answers(), waited_s, self.watch.timeout_s, include_stuck
        )
        raised = None if exc is None else (raising_rank, exc.problem, exc.call_id)
        error = name_failures(self.stage_infos, problems, waited_s, raised, timeout_problem)
        logger.error("%s", error)
        return error

    # -- recovery --------------------------------------------------------------------------

    def replace_stages(self, ranks: list[int]) -> float:
        """Kill the stages at `ranks`, start new actors on their bundles, load their layers,
        re-form the process groups with the survivors and give the new stages caches of the
        engine's size. Returns the seconds it took. The survivors keep their weights; every
        request is recomputed by the engine, so no KV from before the failure is read."""
        started = time.monotonic()
        budget = envs.get_float("VLLM_PP_STAGE_RESTART_TIMEOUT_S")
        # Re-forming the groups is set-up: heartbeat silences count again once it is over
        # (dead or stopped processes on this node are still found at once).
        self.watch.arm(armed=False)
        self._kill_ranks(ranks)
        # The survivors still run (and fail) the steps sent before the failure, before they
        # rejoin: nobody wants those results or errors.
        self.calls.forget()
        survivors = [r for r in range(len(self.workers)) if r not in ranks]
        self._start_actors(ranks, budget)
        self._join(ranks, survivors, budget)
        self._load_replacements(ranks, budget)
        return time.monotonic() - started

    def _kill_ranks(self, ranks: Iterable[int], grace_s: float = 0.0) -> None:
        """Kill the actors (and, on this node, their processes: a frozen one ignores
        everything but SIGKILL), then wait for the processes to be gone. With `grace_s`
        (a normal shutdown), a process gets that long to leave after ray.kill before the
        SIGKILL: Ray logs a SIGKILLed actor as one that "died unexpectedly"."""
        ranks = list(ranks)
        for rank in ranks:
            self.watch.detach(rank)
            if self.workers[rank] is not None:
                try:
                    ray.kill(self.workers[rank], no_restart=True)
                except Exception:  # already dead
                    pass
        for rank in ranks:
            info = self.stage_infos[rank]
            if grace_s <= 0 or not wait_process_gone(info.pid, info.host, grace_s):
                kill_local_process(info.pid, info.host)
        for rank in ranks:
            info = self.stage_infos[rank]
            if not wait_process_gone(info.pid, info.host, 10.0):
                logger.warning("%s: process still there 10 s after SIGKILL", info.describe())
            self.workers[rank] = None
            self.calls.detach(rank)

    def _release_workers(self, graceful: bool) -> None:
        from ray.util.placement_group import remove_placement_group

        standby: list[Any] = getattr(self, "standby", [])
        self.standby = []
        if ray.is_initialized():
            for actor in standby:
                with contextlib.suppress(Exception):  # gone already
                    ray.kill(actor, no_restart=True)
        workers = getattr(self, "workers", [])
        alive = [r for r, w in enumerate(workers) if w is not None]
        if alive and ray.is_initialized():
            if graceful:
                self.calls.forget()  # errors of earlier steps do not matter any more
                try:
                    self.calls.wait_all(alive, self.calls.broadcast(Verb.SHUTDOWN, alive), 10.0)
                except RankCallError:  # a stuck or dead stage must not block the shutdown
                    logger.warning("a stage did not shut down cleanly; killing its actor")
            self._kill_ranks(alive, grace_s=2.0 if graceful else 0.0)
        self._close_calls()
        self.workers = []
        self._remove_rendezvous_dir()
        if getattr(self, "placement_group", None) is not None and ray.is_initialized():
            if getattr(self, "_owns_pg", True):  # never the caller's own group
                remove_placement_group(self.placement_group)
            self.placement_group = None
        if getattr(self, "_owns_ray", False) and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
