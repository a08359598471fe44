"""Ray executor: one actor per rank inside a placement group; the engine process is the driver.

Each step is submitted to every stage actor without waiting. Ray runs an actor's calls in
submission order, and stages hand hidden states to each other over torch.distributed, so
several submitted steps flow through the stages like a pipeline.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from vllm.executor.base import ExecutorBase
from vllm.executor.ray_utils import (
    ACTOR_START_TIMEOUT_S,
    RayWorkerWrapper,
    check_tp_groups_on_one_node,
    get_actor_ips,
    get_or_create_placement_group,
    group_ranks_by_node,
    init_ray,
)
from vllm.logger import init_logger
from vllm.sequence import ExecuteModelRequest, SamplerOutput

logger = init_logger("vllm.executor.ray_executor")


def _threads_per_stage() -> int:
    return int(os.environ.get("VLLM_CPU_THREADS_PER_STAGE", "1"))


class RayExecutor(ExecutorBase):
    """Runs each pipeline stage in its own Ray actor (possibly on another node)."""

    def _init_workers(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        import vllm

        world = self.parallel_config.world_size
        use_gpu = self.device_config.device == "cuda"
        self._owns_ray = init_ray(world, use_gpu)
        self.placement_group, bundles, self._owns_pg = get_or_create_placement_group(
            world, use_gpu
        )
        # Actors import vllm from the same source tree as the driver, installed or not.
        src_root = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
        python_path = os.pathsep.join(p for p in (src_root, os.environ.get("PYTHONPATH")) if p)
        threads = _threads_per_stage()
        env = {"PYTHONPATH": python_path, "OMP_NUM_THREADS": str(threads)}
        for key in (
            "VLLM_LOGGING_LEVEL",
            "VLLM_CONFIGURE_LOGGING",
            "VLLM_PP_CACHE_DIR",
            "VLLM_PP_DISABLE_KERNELS",
            "VLLM_CPU_MALLOC_TUNING",
            "VLLM_CPU_PACKED_LINEAR",
        ):
            if key in os.environ:
                env[key] = os.environ[key]
        actor_cls = ray.remote(
            num_cpus=0 if use_gpu else 1,
            num_gpus=1 if use_gpu else 0,
        )(RayWorkerWrapper)
        self.workers = []
        for rank in range(world):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=bundles[rank],
            )
            self.workers.append(
                actor_cls.options(
                    scheduling_strategy=strategy, runtime_env={"env_vars": env}
                ).remote()
            )
        ips = get_actor_ips(self.workers, None if self._owns_pg else ACTOR_START_TIMEOUT_S)
        self.node_ids: list[str] = ray.get([w.get_node_id.remote() for w in self.workers])
        # TP ranks of a stage are consecutive: keep each node's actors together.
        order = group_ranks_by_node(self.node_ids)
        self.workers = [self.workers[i] for i in order]
        ips = [ips[i] for i in order]
        self.node_ids = [self.node_ids[i] for i in order]
        check_tp_groups_on_one_node(self.node_ids, self.parallel_config.tensor_parallel_size)
        for rank, (ip, node) in enumerate(zip(ips, self.node_ids)):
            logger.info("Rank %d: Ray actor on node %s (id %s)", rank, ip, node[:12])
        port = ray.get(self.workers[0].get_open_port.remote())
        init_method = f"tcp://{ips[0]}:{port}"
        ray.get(
            [
                w.init_worker.remote(
                    model_config=self.model_config,
                    parallel_config=self.parallel_config,
                    scheduler_config=self.scheduler_config,
                    device_config=self.device_config,
                    cache_config=self.cache_config,
                    rank=rank,
                    distributed_init_method=init_method,
                    num_threads=None if use_gpu else threads,
                )
                for rank, w in enumerate(self.workers)
            ]
        )
        # Process-group rendezvous needs every rank at once: submit all, then wait.
        self._run_workers("init_device")
        self._run_workers("load_model")
        self._outstanding: list[Any] = []

    def _run_workers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:

        refs = [w.execute_method.remote(method, *args, **kwargs) for w in self.workers]
        return self._wait_all(refs)

    @staticmethod
    def _wait_all(refs: list[Any]) -> list[Any]:
        """ray.get that fails fast: an error on any rank is raised at once, not after a
        hang of the ranks waiting on it."""
        import ray

        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            ray.get(ready[0])
        return ray.get(refs)

    def execute_model_async(self, request: ExecuteModelRequest) -> Any:
        # Middle stages take their batch from the previous stage; only block ops go to them.
        # With TP every rank of the first and last stage gets the batch (each builds its own
        # inputs); the last stage's TP driver (tp_rank 0) returns the sampler output.
        light = replace(request, seq_group_metadata_list=None)
        tp = self.parallel_config.tensor_parallel_size
        last_stage = self.parallel_config.pipeline_parallel_size - 1
        refs = [
            w.execute_method.remote(
                "execute_model", request if rank // tp in (0, last_stage) else light
            )
            for rank, w in enumerate(self.workers)
        ]
        driver = last_stage * tp
        self._outstanding.extend(refs[:driver] + refs[driver + 1 :])
        return refs[driver]

    def get_output(self, handle: Any) -> SamplerOutput:
        import ray

        # Watch earlier stages too: if one fails, the last stage would wait on it forever.
        pending = [handle, *self._outstanding]
        while True:
            ready, _ = ray.wait(pending, num_returns=1)
            ray.get(ready[0])  # raises the stage's error, if any
            pending = [r for r in pending if r is not ready[0]]
            if ready[0] is handle:
                break
        done, _ = ray.wait(self._outstanding, num_returns=len(self._outstanding), timeout=0)
        for ref in done:
            ray.get(ref)
        done_ids = {id(r) for r in done}
        self._outstanding = [r for r in self._outstanding if id(r) not in done_ids]
        return ray.get(handle)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        workers = getattr(self, "workers", [])
        if workers and ray.is_initialized():
            try:
                ray.get([w.execute_method.remote("shutdown") for w in workers], timeout=10)
            except Exception:  # a stuck or dead stage must not block the rest of shutdown
                logger.warning("a stage did not shut down cleanly; killing its actor")
            for w in workers:
                ray.kill(w)
        self.workers = []
        if getattr(self, "placement_group", None) is not None and ray.is_initialized():
            if getattr(self, "_owns_pg", True):  # never the caller's own group
                remove_placement_group(self.placement_group)
            self.placement_group = None
        if getattr(self, "_owns_ray", False) and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
