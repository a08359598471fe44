"""`PipelineShape`: the running pipeline's layout as one immutable value.

The configs say what the user asked for and never change once built (`vllm.config.FrozenConfig`).
What changes while the engine serves -- a stage that left (PP N -> N-1) or came back, the
layers re-split or merged into a neighbour, the KV block counts that follow -- is a new
`PipelineShape`, with the next generation number. The executor owns the current one and hands
it on: to the engine (which reads the configs as they run now through `running_config`), to
the block manager (its block counts) and to every worker (its stage's layers). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm.config import EngineConfig, ModelConfig, ParallelConfig, derive


@dataclass(frozen=True)
class PipelineShape:
    """PP and TP sizes, the decoder layers of each stage, the KV block counts every stage
    holds (None until the caches are sized) and a generation (+1 per change)."""

    pipeline_parallel_size: int
    tensor_parallel_size: int
    # Decoder layers per stage, in stage order.
    layer_split: tuple[int, ...]
    # The split as the parallel config states it: None (even), "auto" (balanced for the
    # lm_head) or an explicit "8,8,7,7". A configured "auto" stays "auto" after growing back.
    layer_partition: str | None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    generation: int = 0

    def __post_init__(self) -> None:
        for name in ("pipeline_parallel_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PipelineShape.{name} must be an integer >= 1, got {value!r}.")
        split = self.layer_split
        if len(split) != self.pipeline_parallel_size or any(n < 1 for n in split):
            raise ValueError(
                f"PipelineShape.layer_split must give each of the {self.pipeline_parallel_size} "
                f"stages at least one layer, got {list(split)}."
            )
        for name in ("num_gpu_blocks", "num_cpu_blocks"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"PipelineShape.{name} must be >= 0, got {value}.")

    @classmethod
    def configured(cls, engine_config: EngineConfig) -> PipelineShape:
        """The shape the configs ask for (generation 0; block counts once sized)."""
        pc, cc = engine_config.parallel_config, engine_config.cache_config
        return cls(
            pc.pipeline_parallel_size,
            pc.tensor_parallel_size,
            tuple(engine_config.model_config.get_pp_layer_sizes(pc)),
            pc.pp_layer_partition,
            cc.num_gpu_blocks,
            cc.num_cpu_blocks,
        )

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def last_stage_driver_rank(self) -> int:
        """Global rank of the last stage's TP driver (rank = pp_rank x TP + tp_rank)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def stage_layers(self, pp_rank: int) -> tuple[int, int]:
        """The decoder layers [start, end) of stage `pp_rank`."""
        if not 0 <= pp_rank < self.pipeline_parallel_size:
            raise ValueError(
                f"pp_rank {pp_rank} is not a stage of a {self.pipeline_parallel_size}-stage "
                "pipeline."
            )
        start = sum(self.layer_split[:pp_rank])
        return start, start + self.layer_split[pp_rank]

    @property
    def layouts(self) -> list[tuple[int, int]]:
        """Every stage's layers [start, end), in stage order."""
        return [self.stage_layers(s) for s in range(self.pipeline_parallel_size)]

    # -- changes: each returns the next generation ---------------------------------------------

    def resized(
        self,
        pipeline_parallel_size: int,
        layer_split: list[int] | tuple[int, ...],
        layer_partition: str | None,
    ) -> PipelineShape:
        """`pipeline_parallel_size` stages holding `layer_split` (stated as `layer_partition`:
        None for even, "auto", or the split itself)."""
        return replace(
            self,
            pipeline_parallel_size=pipeline_parallel_size,
            layer_split=tuple(layer_split),
            layer_partition=layer_partition,
            generation=self.generation + 1,
        )

    def resplit(self, layer_split: list[int] | tuple[int, ...]) -> PipelineShape:
        """The same stages with `layer_split` (stated explicitly from now on)."""
        return replace(
            self,
            layer_split=tuple(layer_split),
            layer_partition=",".join(str(n) for n in layer_split),
            generation=self.generation + 1,
        )

    def with_partition(self, layer_partition: str | None) -> PipelineShape:
        """The same split, stated as `layer_partition` (a configured "auto" restored after
        growing back: it gives the split in effect)."""
        return replace(self, layer_partition=layer_partition, generation=self.generation + 1)

    def with_blocks(self, num_gpu_blocks: int, num_cpu_blocks: int) -> PipelineShape:
        """Every stage's cache at these (device, host) block counts."""
        return replace(
            self,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            generation=self.generation + 1,
        )

    # -- the configs as the pipeline runs now --------------------------------------------------

    def parallel_config(self, configured: ParallelConfig) -> ParallelConfig:
        """`configured` with this shape's size and split (a frozen copy)."""
        return derive(
            configured,
            pipeline_parallel_size=self.pipeline_parallel_size,
            pp_layer_partition=self.layer_partition,
        )

    def running_config(self, configured: EngineConfig) -> EngineConfig:
        """The engine's configs with this shape applied: the parallel config's size and
        split, the cache config's block counts. Frozen copies; `configured` is unchanged."""
        cache = derive(
            configured.cache_config,
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
        )
        return replace(
            configured, parallel_config=self.parallel_config(configured.parallel_config),
            cache_config=cache,
        )  # fmt: skip


def split_layers(
    model_config: ModelConfig, pipeline_parallel_size: int, layer_partition: str | None
) -> list[int]:
    """Decoder layers per stage for `pipeline_parallel_size` stages under `layer_partition`."""
    from vllm.distributed.layer_split import get_pp_layer_sizes

    return get_pp_layer_sizes(
        model_config.get_num_layers(),
        pipeline_parallel_size,
        layer_partition,
        model_config.get_lm_head_cost_in_layers(),
    )
