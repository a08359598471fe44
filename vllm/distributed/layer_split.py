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


def validate_layer_split(
    layer_split: object, num_layers: int, pp_size: int, name: str = "layer_split"
) -> list[int]:
    """A split given as a list of layers per stage (a re-split while serving), checked like
    `parse_layer_partition`: one positive integer per stage, summing to the model's layers.
    A ValueError names `name` (the parameter or request field)."""
    if not isinstance(layer_split, (list, tuple)) or not all(
        isinstance(size, int) and not isinstance(size, bool) for size in layer_split
    ):
        raise ValueError(
            f"{name} must be a list of integers (layers per stage), got {layer_split!r}."
        )
    sizes = list(layer_split)
    if len(sizes) != pp_size:
        raise ValueError(
            f"{name} {sizes} has {len(sizes)} entries but pipeline_parallel_size is {pp_size}."
        )
    if any(size < 1 for size in sizes) or sum(sizes) != num_layers:
        raise ValueError(
            f"{name} {sizes} must give every stage at least one layer and sum to the model's "
            f"{num_layers} layers."
        )
    return sizes


def rebalanced_layer_sizes(
    sizes: list[int], stage_seconds: list[float], head_cost: float = 0.0
) -> tuple[list[int], float, float]:
    """A split for stages of measured speeds: `stage_seconds[i]` is stage i's time per step
    with `sizes[i]` layers (the last stage also runs the lm_head, worth `head_cost` layers).

    Each stage's time per layer-unit is taken as constant, so stage i with n layers is
    predicted to take n x its unit time (the last stage n + head_cost units). Layers go one
    at a time to the stage whose time grows least, which minimises the slowest stage's time
    (every stage keeps at least one layer). Returns (new sizes, measured step time, predicted
    step time), the step time being the slowest stage's."""
    if len(sizes) != len(stage_seconds) or not sizes:
        raise ValueError("stage_seconds must give one time per stage.")
    last = len(sizes) - 1
    fixed = [head_cost if i == last else 0.0 for i in range(len(sizes))]
    unit = [max(t, 0.0) / (n + f) for t, n, f in zip(stage_seconds, sizes, fixed)]
    new = [1] * len(sizes)
    for _ in range(sum(sizes) - len(sizes)):
        # Ties go to the earlier stage (a deterministic choice).
        stage = min(range(len(sizes)), key=lambda i: ((new[i] + 1 + fixed[i]) * unit[i], i))
        new[stage] += 1
    measured = max(stage_seconds)
    predicted = max((n + f) * u for n, f, u in zip(new, fixed, unit))
    return new, measured, predicted
