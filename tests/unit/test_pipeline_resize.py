"""How ranks are renumbered when whole stages leave the pipeline or come back."""

from __future__ import annotations

import pytest

from vllm.distributed.pipeline_resize import merged_split, stages_of, with_stages, without_stages

# Torch-free unit tests: part of `make test-fast`.
pytestmark = pytest.mark.fast


def test_a_middle_stage_leaves_and_the_survivors_close_up_in_order():
    plan = without_stages(3, 1, [1])
    assert (plan.old_pp, plan.new_pp) == (3, 2)
    assert plan.order == [0, 2]
    assert plan.leaving == [1]
    assert plan.staying == [0, 1]
    assert plan.joining == []


def test_a_stage_leaves_with_all_its_tp_ranks():
    # TP = 2, PP = 3: stage 1 holds ranks 2 and 3; one of them failing takes both out.
    plan = without_stages(3, 2, [3])
    assert plan.leaving == [2, 3]
    assert plan.order == [0, 1, 4, 5]
    assert plan.new_pp == 2
    # The grid stays rank = pp_rank * tp + tp_rank: old stage 2 is new stage 1, same tp ranks.
    assert [(new // 2, new % 2) for new in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [old % 2 for old in plan.order] == [0, 1, 0, 1]


def test_the_first_stage_leaving_leaves_one_stage():
    plan = without_stages(2, 1, [0])
    assert plan.order == [1]
    assert plan.new_pp == 1


def test_two_stages_can_leave_at_once():
    plan = without_stages(4, 1, [3, 0])
    assert plan.order == [1, 2]
    assert plan.leaving == [0, 3]
    assert plan.new_pp == 2


@pytest.mark.parametrize("ranks", [[], [4], [-1]])
def test_ranks_outside_the_pipeline_are_refused(ranks):
    with pytest.raises(ValueError, match="failed_ranks"):
        without_stages(2, 2, ranks)


def test_no_stage_left_is_refused():
    with pytest.raises(ValueError, match="no stage would be left"):
        without_stages(2, 1, [0, 1])


def test_stages_come_back_as_the_last_ones():
    plan = with_stages(2, 2, 1)
    assert (plan.old_pp, plan.new_pp) == (2, 3)
    assert plan.order == [0, 1, 2, 3, None, None]
    assert plan.joining == [4, 5]
    assert plan.staying == [0, 1, 2, 3]
    assert plan.leaving == []
    with pytest.raises(ValueError, match="num_stages"):
        with_stages(2, 1, 0)


def test_stages_of_ranks():
    assert stages_of([5, 1, 0], 2) == [0, 2]


def test_a_lost_stage_goes_to_one_neighbour_and_the_others_keep_their_ranges():
    # The previous stage takes a middle or last stage's layers; the first stage's go to the
    # next one, which becomes the first.
    assert merged_split([2, 2, 2], 1) == ([4, 2], 0)
    assert merged_split([2, 2, 2], 2) == ([2, 4], 1)
    assert merged_split([2, 2, 2], 0) == ([4, 2], 0)
    assert merged_split([8, 8, 7, 7], 2) == ([8, 15, 7], 1)
    assert merged_split([3, 3], 1) == ([6], 0)


@pytest.mark.parametrize("sizes, lost", [([2, 2], 2), ([2, 2], -1), ([6], 0)])
def test_merged_split_names_lost_stage(sizes, lost):
    with pytest.raises(ValueError, match="lost_stage"):
        merged_split(sizes, lost)
