"""Ray plumbing: joining or starting a cluster, placing one bundle per rank, the actor class."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import ray

from vllm import envs
from vllm.logger import init_logger

logger = init_logger("vllm.executor.ray_utils")

# How long to wait for the placement group before failing with a clear error (seconds).
_PLACEMENT_TIMEOUT_S = envs.get_float("VLLM_PP_PLACEMENT_TIMEOUT")
# How long rank actors may take to start inside a caller's placement group (seconds).
ACTOR_START_TIMEOUT_S = envs.get_float("VLLM_PP_ACTOR_START_TIMEOUT")


class RayWorkerWrapper:
    """The actor body: holds the rank's Worker (built by the first call) in the actor process.

    Ray starts, places and kills the actor; the engine's calls to the Worker -- set-up, steps,
    stats, shutdown -- come over a connection of their own (`open_calls`,
    `vllm.executor.rank_calls`), one at a time and in order, on a thread of their own. The
    engine's heartbeats come over another (`open_heartbeat`), answered by a third thread, so
    they are answered while a step runs -- or is stuck waiting on a neighbour -- and only a
    dead or frozen process leaves them unanswered."""

    def __init__(self) -> None:
        from vllm.logger import configure_logging
        from vllm.worker.rank_server import CallsThread, WorkerHost

        configure_logging()
        self._host = WorkerHost()
        # Before anything here imports torch: the calls thread must be the one that does.
        self._calls = CallsThread(self._host, first=_import_torch)

    def open_calls(self, engine_public: bytes) -> tuple[str, int, bytes]:
        """Listen for the engine's connection (see `rank_server.CallsThread`): the address,
        and this rank's public key for the handshake (only public keys cross Ray)."""
        return self._calls.listen(self.get_node_ip(), engine_public)

    def get_node_ip(self) -> str:
        from vllm.distributed.net_utils import get_ip

        return get_ip()

    def get_node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def get_open_port(self) -> int:
        from vllm.distributed.net_utils import get_open_port

        return get_open_port()

    def open_heartbeat(self, engine_public: bytes) -> tuple[str, int, bytes, int, str]:
        """Listen for the engine's heartbeat connection: (ip, port, this listener's public key,
        this process's pid, its host name) -- the engine watches the process itself when it
        runs on its node."""
        import socket

        from vllm.worker.rank_server import listen_for_heartbeats

        ip = self.get_node_ip()
        port, rank_public = listen_for_heartbeats(ip, engine_public, self._host.busy_s)
        return ip, port, rank_public, os.getpid(), socket.gethostname()

    def gc_frozen_objects(self) -> int:
        """How many objects are frozen out of the cyclic GC in this actor (diagnostics)."""
        return gc.get_freeze_count()


def _import_torch() -> None:
    import torch  # noqa: F401  (loaded on the calling thread; see CallsThread)


def init_ray(world_size: int, use_gpu: bool) -> bool:
    """Connect to Ray: the running instance, the cluster at RAY_ADDRESS, or a new local one.

    Returns True if this call started a local instance (the engine then shuts it down). A new
    local instance gets at least `world_size` logical CPUs, so PP=4 runs on a 2-core machine
    (oversubscribed, with a warning) instead of never placing.
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return False
    cpus = os.cpu_count() or 1
    num_cpus = max(cpus, world_size)
    if not use_gpu and world_size > cpus:
        logger.warning(
            "pipeline of %d stages on %d CPU cores: stages are oversubscribed", world_size, cpus
        )
    # address="local": always a new instance. Without it Ray joins any cluster that `ray start`
    # left on this machine (and then refuses num_cpus), which is what RAY_ADDRESS is for.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    return True


def _missing_message(resource: str, world_size: int, free: float) -> str:
    missing = max(world_size - free, 0)
    return (
        f"{world_size} {resource}s are needed (one per rank: pipeline_parallel_size x "
        f"tensor_parallel_size = {world_size}) but only {free:g} are free: {missing:g} "
        f"{resource}{'s' if missing != 1 else ''} missing"
    )


def create_placement_group(world_size: int, use_gpu: bool) -> Any:
    """One bundle per rank ({"GPU": 1} or {"CPU": 1}); a clear error if it cannot be placed."""
    from ray.util.placement_group import placement_group, remove_placement_group

    resource = "GPU" if use_gpu else "CPU"
    total = ray.cluster_resources().get(resource, 0)
    if total < world_size:
        raise ValueError(
            f"The number of required {resource}s exceeds the total number of available "
            f"{resource}s in the cluster: pipeline_parallel_size x tensor_parallel_size = "
            f"{world_size} ranks need {world_size} {resource} bundles, the Ray cluster has "
            f"{total:g} ({world_size - total:g} {resource}s missing)."
        )
    # PACK keeps the TP ranks of a stage (adjacent ranks, adjacent bundles) on one node.
    pg = placement_group([{resource: 1}] * world_size, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=_PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        free = ray.available_resources().get(resource, 0)
        raise ValueError(
            f"Could not place {world_size} {resource} bundles within "
            f"{_PLACEMENT_TIMEOUT_S:g} s: the cluster has {total:g} {resource}s but "
            f"only {free:g} are free ({_missing_message(resource, world_size, free)}). "
            "Free them (another engine or actor may hold them), or run the engine inside a "
            "Ray task/actor that holds a placement group sized for it: it then uses that "
            "group's bundles."
        ) from None
    return pg


def get_or_create_placement_group(world_size: int, use_gpu: bool) -> tuple[Any, list[int], bool]:
    """The placement group the ranks go into: (group, bundle index per rank, owned by us).

    Inside a Ray task or actor that already runs in a placement group (vLLM's Ray Data
    pattern: the caller sized a group for the engine), its bundles are used as they are and
    no second group is created -- which could never be placed when the first holds every
    CPU/GPU of the cluster. Otherwise a new group of one bundle per rank is created; only that
    one is removed at shutdown.
    """
    from ray.util import get_current_placement_group

    resource = "GPU" if use_gpu else "CPU"
    current = get_current_placement_group()
    if current is None:
        return create_placement_group(world_size, use_gpu), list(range(world_size)), True
    bundles = [i for i, bundle in enumerate(current.bundle_specs) if bundle.get(resource, 0) >= 1]
    if len(bundles) < world_size:
        raise ValueError(
            f"The number of required {resource}s exceeds the total number of available "
            f"{resource}s in the placement group: this Ray task/actor runs in a placement "
            f"group with {len(bundles)} bundle(s) holding a {resource}, and "
            f"pipeline_parallel_size x tensor_parallel_size = {world_size} ranks need one "
            f"each ({world_size - len(bundles)} missing)."
        )
    logger.info(
        "Using the current placement group's bundles %s (the caller's; none is created)",
        bundles[:world_size],
    )
    return current, bundles[:world_size], False


def caller_group_start_error(timeout: float) -> ValueError:
    """Rank actors did not start in the caller's placement group: say why that happens."""
    return ValueError(
        f"Ray actors of the engine's ranks did not start within {timeout:g} s in the caller's "
        "placement group: their bundles have no free resources (does the calling task/actor "
        "hold them? give it num_cpus=0 inside the group), or VLLM_PP_ACTOR_START_TIMEOUT is "
        "too short for this machine."
    )


def group_ranks_by_node(node_ids: list[str]) -> list[int]:
    """An order of the actors that puts those on the same node next to each other (nodes in
    order of first appearance, actors in bundle order within a node), so the consecutive ranks
    of a stage's TP group share a node, as vLLM assigns ranks. PACK already places bundles
    node by node in most cases; this makes it hold when it does not."""
    first_seen: dict[str, int] = {}
    for node in node_ids:
        first_seen.setdefault(node, len(first_seen))
    return sorted(range(len(node_ids)), key=lambda i: (first_seen[node_ids[i]], i))


def check_tp_groups_on_one_node(node_ids: list[str], tp_size: int) -> None:
    """Warn when a stage's TP ranks span nodes: every layer then all-reduces across them."""
    for start in range(0, len(node_ids), tp_size):
        if len(set(node_ids[start : start + tp_size])) > 1:
            logger.warning(
                "the TP ranks %d-%d of one stage run on different nodes: each layer's "
                "all-reduce crosses the network (give each node a multiple of "
                "tensor_parallel_size CPUs/GPUs)",
                start,
                start + tp_size - 1,
            )


def alive_nodes() -> set[str]:
    """The ids of the Ray nodes the cluster counts as alive now."""
    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}


def bundle_nodes(pg: Any, bundles: list[int]) -> dict[int, str]:
    """The node each of `bundles` of `pg` is reserved on ("" while it has none: its node
    left the cluster and Ray has not re-placed it yet, or cannot)."""
    from ray.util.placement_group import placement_group_table

    placed = placement_group_table(pg).get("bundles_to_node_id", {})
    alive = alive_nodes()
    return {b: placed[b] if placed.get(b) in alive else "" for b in bundles}


def wait_bundles_placed(
    pg: Any, bundles: dict[int, int], timeout: float, resource: str
) -> dict[int, str]:
    """Wait until each rank's bundle (`bundles`: rank -> bundle index) is reserved on a live
    node, at most `timeout` s (0: look once); returns rank -> node id.

    A bundle whose node leaves the cluster is re-placed by Ray on a node with room -- at once
    when one has it. An actor started on a bundle that has no node waits for one without
    end; this raises instead, naming the ranks, so a stage that cannot come back leaves the
    pipeline (or a return is put off) without waiting for the whole restart deadline."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = bundle_nodes(pg, sorted(set(bundles.values())))
        missing = [rank for rank, b in bundles.items() if not nodes[b]]
        if not missing:
            return {rank: nodes[b] for rank, b in bundles.items()}
        if time.monotonic() >= deadline:
            free = ray.available_resources().get(resource, 0)
            waited = f"within {timeout:g} s (VLLM_PP_PLACEMENT_TIMEOUT)" if timeout else "now"
            raise RuntimeError(
                f"the placement-group bundle(s) {[bundles[r] for r in missing]} of rank(s) "
                f"{missing} have no node: the node they were on left the Ray cluster and no "
                f"node still there had a {resource} for them {waited} ({free:g} "
                f"{resource}s free outside placement groups)"
            )
        time.sleep(0.1)


def placement_timeout_s() -> float:
    """VLLM_PP_PLACEMENT_TIMEOUT, read now (a bundle's re-placement after a node loss)."""
    return envs.get_float("VLLM_PP_PLACEMENT_TIMEOUT")
