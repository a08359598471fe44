"""build_processor: a Ray Data dataset -> the same rows with generated text (or, with
`task_type="embed"`, their embeddings), N `LLM` replicas.

As vLLM's Ray Data example: `map_batches` over `LLMPredictor`, a fixed pool of
`num_instances` actors, and for each actor its own placement group of one bundle per rank
(pipeline_parallel_size x tensor_parallel_size), STRICT_PACK on one node. The actor itself
takes no CPU (`num_cpus=0`) so the bundles are left for the engine's stages, and
`placement_group_capture_child_tasks=True` puts the stages the engine starts into that group.
On CPU a bundle is {"CPU": c}; on GPU {"GPU": 1, "CPU": c}.

    with build_processor("smollm2", num_instances=2, pipeline_parallel_size=1,
                         sampling_params={"temperature": 0, "max_tokens": 32}) as processor:
        processor(ray.data.read_text("prompts.txt")).write_parquet("out/")

The placement groups are created from the driver when Ray Data starts each actor and live as
long as the driver; leaving the `with` block (or `processor.shutdown()`) removes them. When an
instance's node leaves the cluster, Ray re-places its group on a node with room, restarts the
actor there (a new engine) and retries the batch it was running (Ray Data's actor fault
tolerance, on by default).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from vllm import envs
from vllm.batch.embed_predictor import EmbeddingPredictor
from vllm.batch.predictor import LLMPredictor
from vllm.sampling_params import SamplingParams


def instance_bundles(
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    use_gpu: bool = False,
    cpus_per_rank: float = 1,
) -> list[dict[str, float]]:
    """The placement-group bundles of one instance: one per rank (PP x TP)."""
    world = pipeline_parallel_size * tensor_parallel_size
    if world < 1:
        raise ValueError(f"pipeline_parallel_size x tensor_parallel_size must be >= 1, got {world}")
    bundle: dict[str, float] = {"CPU": cpus_per_rank}
    if use_gpu:
        bundle = {"GPU": 1, "CPU": cpus_per_rank}
    return [dict(bundle) for _ in range(world)]


class BatchProcessor:
    """Callable on a Ray Dataset; owns the placement groups of its instances."""

    def __init__(
        self,
        model: str,
        *,
        num_instances: int = 1,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        batch_size: int = 32,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        prompt_column: str = "prompt",
        messages_column: str = "messages",
        apply_chat_template: bool = False,
        engine_kwargs: Mapping[str, Any] | None = None,
        device: str = "auto",
        cpus_per_rank: float = 1,
        placement_strategy: str = "STRICT_PACK",
        task_type: str = "generate",
        pooling_params: Any = None,
    ) -> None:
        if task_type not in ("generate", "embed"):
            raise ValueError(f"task_type must be 'generate' or 'embed', got {task_type!r}")
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.num_instances = num_instances
        self.batch_size = batch_size
        self.use_gpu = _use_gpu(device)
        self.bundles = instance_bundles(
            pipeline_parallel_size, tensor_parallel_size, self.use_gpu, cpus_per_rank
        )
        self.placement_strategy = placement_strategy
        engine_kwargs = dict(engine_kwargs or {})
        engine_kwargs.update(
            pipeline_parallel_size=pipeline_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
        )
        if len(self.bundles) > 1:
            engine_kwargs.setdefault("distributed_executor_backend", "ray")
        if not self.use_gpu:
            engine_kwargs.setdefault("device", "cpu")
        self.predictor_kwargs = dict(
            model=model,
            sampling_params=sampling_params,
            prompt_column=prompt_column,
            messages_column=messages_column,
            apply_chat_template=apply_chat_template,
            engine_kwargs=engine_kwargs,
        )
        # ray.data.llm's task_type: "embed" maps a column of texts to a column of vectors.
        self.predictor: type[LLMPredictor] = LLMPredictor
        if task_type == "embed":
            self.predictor = EmbeddingPredictor
            self.predictor_kwargs["pooling_params"] = pooling_params
        self.placement_groups: list[Any] = []

    def scheduling_strategy(self) -> dict[str, Any]:
        """Ray Data's `ray_remote_args_fn`: each actor it starts gets a new placement group.

        Ray Data also calls this function when it is not starting an actor (its memory issue
        detector reads the remote args at start and every 30 s). A group made for such a call
        would hold its CPUs until the driver exits, so the group is created only when Ray
        reads the strategy's `placement_group` to start an actor."""
        return {"scheduling_strategy": _group_on_first_use(self._create_group)}

    def _create_group(self) -> Any:
        from ray.util.placement_group import placement_group

        pg = placement_group(self.bundles, strategy=self.placement_strategy)
        self.placement_groups.append(pg)
        return pg

    def __call__(self, dataset: Any) -> Any:
        import ray.data

        cpus = int(max(1, self.bundles[0]["CPU"]))
        return dataset.map_batches(
            self.predictor,
            fn_constructor_kwargs=self.predictor_kwargs,
            compute=ray.data.ActorPoolStrategy(size=self.num_instances),
            batch_size=self.batch_size,
            batch_format="numpy",
            # The actor takes no CPU: its group's bundles are for the engine's ranks (a PP=1
            # engine runs inside the actor, on its bundle's CPUs). On GPU a one-rank engine
            # runs in the actor too, so the actor takes that bundle's GPU (Ray then makes it
            # visible to the actor, as the seed's num_gpus=1); a PP/TP engine's ranks take theirs.
            num_cpus=0,
            num_gpus=1 if self.use_gpu and len(self.bundles) == 1 else 0,
            ray_remote_args_fn=self.scheduling_strategy,
            runtime_env={"env_vars": _actor_env(cpus)},
            # No max_restarts / max_task_retries here: Ray Data's defaults (-1, -1) restart an
            # instance whose node left the cluster in its group -- re-placed by Ray on a node
            # with room -- and send the batch it was running again, so no row is lost or
            # answered twice; Ray Data deprecates passing them (tests/distributed/
            # test_ray_node_loss.py holds the behaviour).
        )

    def shutdown(self) -> None:
        """Remove the placement groups created for the instances (after the dataset ran)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        groups, self.placement_groups = self.placement_groups, []
        if not ray.is_initialized():
            return
        for pg in groups:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed, or the cluster is going away
                pass

    def __enter__(self) -> BatchProcessor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def build_processor(model: str, **kwargs: Any) -> BatchProcessor:
    """A processor for `model`: `processor(dataset)` returns the dataset with the generated
    columns (see LLMPredictor). Keyword arguments: those of BatchProcessor."""
    return BatchProcessor(model, **kwargs)


def _group_on_first_use(create: Callable[[], Any]) -> Any:
    """A PlacementGroupSchedulingStrategy (capturing child tasks) whose group is created by
    `create()` the first time Ray reads it."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    class GroupOnFirstUse(PlacementGroupSchedulingStrategy):
        def __init__(self) -> None:
            self._group: Any = None
            super().__init__(None, placement_group_capture_child_tasks=True)

        @property  # type: ignore[override]
        def placement_group(self) -> Any:
            if self._group is None:
                self._group = create()
            return self._group

        @placement_group.setter
        def placement_group(self, value: Any) -> None:
            self._group = value

        def __deepcopy__(self, memo: dict) -> Any:
            return self  # one strategy, one group, however often Ray Data copies the args

        def __reduce__(self) -> Any:
            return (PlacementGroupSchedulingStrategy, (self.placement_group, -1, True))

    return GroupOnFirstUse()


def _actor_env(cpus_per_rank: int) -> dict[str, str]:
    """The instance actors import vllm from the driver's source tree (installed or not), get
    the driver's VLLM_* settings, and each rank uses the CPUs of its bundle (a PP=1 engine
    would otherwise take every core of the node, which the other instances share)."""
    import vllm

    src_root = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (src_root, os.environ.get("PYTHONPATH")) if p)}
    env["VLLM_CPU_THREADS_PER_STAGE"] = str(cpus_per_rank)
    env.update(envs.environment_to_forward())
    return env


def _use_gpu(device: str) -> bool:
    if device == "cpu":
        return False
    if device == "cuda":
        return True
    if device != "auto":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
