"""The one function that splits decoder layers over pipeline stages."""

from __future__ import annotations

import pytest

from vllm.distributed.layer_split import (
    get_pp_layer_range,
    get_pp_layer_sizes,
    rebalanced_layer_sizes,
    validate_layer_split,
)

# Torch-free unit tests: part of `make test-fast`.
pytestmark = pytest.mark.fast


def test_even_split_gives_the_remainder_to_the_first_stages():
    assert get_pp_layer_sizes(30, 4) == [8, 8, 7, 7]
    assert get_pp_layer_sizes(6, 4) == [2, 2, 1, 1]
    assert get_pp_layer_sizes(30, 1) == [30]
    assert [get_pp_layer_range(30, r, 4) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]


def test_user_partition_and_its_errors():
    assert get_pp_layer_sizes(30, 3, "10,12,8") == [10, 12, 8]
    with pytest.raises(ValueError, match="has 2 entries"):
        get_pp_layer_sizes(30, 3, "15,15")
    with pytest.raises(ValueError, match="sum to the model's 30 layers"):
        get_pp_layer_sizes(30, 2, "10,10")
    with pytest.raises(ValueError, match="comma-separated integers"):
        get_pp_layer_sizes(30, 2, "a,b")


def test_auto_partition_balances_the_lm_head():
    # SmolLM2: the lm_head costs 8 layers; the last stage gets 8 fewer layers' worth.
    assert get_pp_layer_sizes(30, 2, "auto", head_cost=8.0) == [19, 11]
    sizes = get_pp_layer_sizes(30, 4, "auto", head_cost=8.0)
    assert sum(sizes) == 30 and min(sizes) >= 1
    assert max(max(sizes[:-1]), sizes[-1] + 8) == 10  # best possible bottleneck
    # A huge head leaves the last stage one layer, never zero.
    assert get_pp_layer_sizes(6, 4, "auto", head_cost=70.0) == [2, 2, 1, 1]
    assert get_pp_layer_sizes(30, 1, "auto", head_cost=8.0) == [30]


@pytest.mark.parametrize("pp", [0, -1, 31])
def test_bad_sizes(pp):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        get_pp_layer_sizes(30, pp)


def test_a_split_given_as_a_list_is_checked_naming_the_parameter():
    assert validate_layer_split([2, 4], 6, 2) == [2, 4]
    assert validate_layer_split((1, 1, 4), 6, 3) == [1, 1, 4]
    bad = {
        "has 3 entries but pipeline_parallel_size is 2": [2, 2, 2],
        "at least one layer": [0, 6],
        "sum to the model's 6 layers": [3, 4],
        "must be a list of integers": "3,3",
    }
    for message, split in bad.items():
        with pytest.raises(ValueError, match=message) as info:
            validate_layer_split(split, 6, 2)
        assert str(info.value).startswith("layer_split ")
    for split in ([3.0, 3], [True, 5], None, [3, "3"]):
        with pytest.raises(ValueError, match="layer_split must be a list of integers"):
            validate_layer_split(split, 6, 2)
    with pytest.raises(ValueError, match="^body.split "):
        validate_layer_split([1], 6, 2, name="body.split")


def test_rebalance_moves_layers_off_the_slow_stage():
    # Stage 1 takes 3x as long per layer (0.3 s against 0.1 s): [5, 1] takes 0.5 s per
    # step, [4, 2] 0.6 s, the even split 0.9 s.
    new, measured, predicted = rebalanced_layer_sizes([3, 3], [0.3, 0.9])
    assert new == [5, 1]
    assert measured == pytest.approx(0.9)
    assert predicted == pytest.approx(0.5)
    # Equal stages: nothing better than the even split.
    new, measured, predicted = rebalanced_layer_sizes([2, 2, 2], [0.2, 0.2, 0.2])
    assert new == [2, 2, 2] and predicted == pytest.approx(measured)
    # Every stage keeps a layer, however slow.
    new, _, _ = rebalanced_layer_sizes([2, 2, 2], [0.2, 100.0, 0.2])
    assert new == [3, 1, 2]  # ties go to the earlier stage


def test_rebalance_counts_the_lm_head_on_the_last_stage():
    # Last stage: 2 layers + a head worth 2 layers take 0.4 s (0.1 per unit), like stage 0's
    # 4 layers: balanced already, so moving a layer would only slow one stage down.
    new, measured, predicted = rebalanced_layer_sizes([4, 2], [0.4, 0.4], head_cost=2.0)
    assert new == [4, 2] and predicted == pytest.approx(measured)
    # Without the head counted the last stage would look twice as slow per layer.
    new, _, _ = rebalanced_layer_sizes([4, 2], [0.4, 0.4])
    assert new == [3, 3] or new == [4, 2]


def test_rebalance_refuses_mismatched_times():
    with pytest.raises(ValueError, match="stage_seconds"):
        rebalanced_layer_sizes([3, 3], [0.1])
