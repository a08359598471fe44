"""Which decoder layers each pipeline stage owns: one function for the whole engine."""

from __future__ import annotations


def parse_layer_partition(partition: str, num_layers: int, pp_size: int) -> list[int]:
    """Parse a user split such as "8,8,7,7" (VLLM_PP_LAYER_PARTITION) and validate it."""
    try:
        sizes = [int(part) for part in partition.split(",")]
    except ValueError as err:
        raise ValueError(
            f"pp_layer_partition must be comma-separated integers, got {partition!r}."
        ) from err
    if len(sizes) != pp_size:
        raise ValueError(
            f"pp_layer_partition {partition!r} has {len(sizes)} entries but "
            f"pipeline_parallel_size is {pp_size}."
        )
    if any(size < 1 for size in sizes) or sum(sizes) != num_layers:
        raise ValueError(
            f"pp_layer_partition {partition!r} must give every stage at least one layer and "
            f"sum to the model's {num_layers} layers."
        )
    return sizes


def balanced_layer_sizes(num_layers: int, pp_size: int, head_cost: float) -> list[int]:
    """Split so the slowest stage is as fast as possible when the last stage also runs the
    lm_head (and sampling), which costs `head_cost` decoder layers' worth of work."""
    best: tuple[float, list[int]] | None = None
    for last in range(1, num_layers - pp_size + 2):
        base, extra = divmod(num_layers - last, pp_size - 1)
        sizes = [base + (1 if r < extra else 0) for r in range(pp_size - 1)] + [last]
        cost = max(max(sizes[:-1]), last + head_cost)
        # Ties go to the larger last stage: fewer layers on the busiest other stage.
        if best is None or cost <= best[0]:
            best = (cost, sizes)
    assert best is not None
    return best[1]


def get_pp_layer_sizes(
    num_layers: int, pp_size: int, partition: str | None = None, head_cost: float = 0.0
) -> list[int]:
    """Layers per stage. Even split by default; the first stages take the remainder
    (30 layers on 4 stages -> 8/8/7/7). `partition="auto"` balances compute instead, giving
    the last stage fewer layers to make up for its lm_head (`head_cost`, in layers)."""
    if not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {pp_size!r}.")
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size ({pp_size}) must not exceed the number of hidden layers "
            f"({num_layers}): every stage needs at least one decoder layer."
        )
    if partition == "auto":
        if pp_size == 1:
            return [num_layers]
        return balanced_layer_sizes(num_layers, pp_size, head_cost)
    if partition:
        return parse_layer_partition(partition, num_layers, pp_size)
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if rank < extra else 0) for rank in range(pp_size)]


def get_pp_layer_range(
    num_layers: int,
    pp_rank: int,
    pp_size: int,
    partition: str | None = None,
    head_cost: float = 0.0,
) -> tuple[int, int]:
    """The `[start, end)` decoder layers owned by stage `pp_rank`."""
    sizes = get_pp_layer_sizes(num_layers, pp_size, partition, head_cost)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}.")
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]
