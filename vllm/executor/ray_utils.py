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


# Ray concurrency group whose thread answers health checks while a step runs.
HEALTH_GROUP = "health"


class RayWorkerWrapper:
    """The actor body: builds a Worker lazily inside the actor process and runs its methods.

    Steps and set-up run one at a time, in submission order, on the actor's default thread;
    `ping` runs on a thread of its own (concurrency group "health"), so it answers while a
    step is running -- or is stuck waiting on a neighbour -- and only a dead or frozen process
    leaves it unanswered."""

    def __init__(self) -> None:
        from vllm.logger import configure_logging

        configure_logging()
        self.worker: Any = None

    def init_worker(self, **kwargs: Any) -> None:
        from vllm.worker.worker import Worker

        self.worker = Worker(**kwargs)

    def get_node_ip(self) -> str:
        from vllm.model_executor.parallel_utils.parallel_state import get_ip

        return get_ip()

    def get_node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def get_open_port(self) -> int:
        from vllm.model_executor.parallel_utils.parallel_state import get_open_port

        return get_open_port()

    def execute_method(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.worker, method)(*args, **kwargs)
        if method == "initialize_cache":
            # From here on this process only serves its stage, and what exists now (torch,
            # the model, the cache) lives until the actor exits. Frozen, it stays out of the
            # cyclic GC's full collections, which would otherwise pause a step now and then
            # for 0.1 s or more -- and a paused stage stalls the whole pipeline.
            gc.collect()
            gc.freeze()
        return result

    @ray.method(concurrency_group=HEALTH_GROUP)
    def ping(self) -> dict[str, Any]:
        """Liveness: this process's pid and how long its current step has run (None if idle)."""
        busy_since = getattr(self.worker, "busy_since", None)
        busy_s = None if busy_since is None else time.perf_counter() - busy_since
        return {"pid": os.getpid(), "busy_s": busy_s}

    def gc_frozen_objects(self) -> int:
        """How many objects are frozen out of the cyclic GC in this actor (diagnostics)."""
        return gc.get_freeze_count()


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
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    return True


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
            f"{total:g}."
        )
    pg = placement_group([{resource: 1}] * world_size, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=_PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ValueError(
            f"Could not place {world_size} {resource} bundles within "
            f"{_PLACEMENT_TIMEOUT_S:g} s: the cluster has {total:g} {resource}s but "
            f"only {ray.available_resources().get(resource, 0):g} are free."
        ) from None
    return pg
