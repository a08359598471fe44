"""The one function that splits decoder layers over pipeline stages."""

from __future__ import annotations

import pytest

from vllm.distributed.layer_split import get_pp_layer_range, get_pp_layer_sizes

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
