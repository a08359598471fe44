"""A placement-group bundle whose node left the Ray cluster (`ray_utils.wait_bundles_placed`):
Ray's tables stubbed, no cluster started."""

from __future__ import annotations

import importlib

import pytest

ray = pytest.importorskip("ray")
# The module, not `ray.util.placement_group` (the function of that name shadows it there).
pg_module = importlib.import_module("ray.util.placement_group")

from vllm.executor import ray_utils  # noqa: E402

ALIVE, DEAD, SPARE = "a" * 56, "d" * 56, "s" * 56


@pytest.fixture
def cluster(monkeypatch):
    """Ray's view, as the test sets it: nodes (id -> alive) and each bundle's node."""
    state = {"nodes": {ALIVE: True, DEAD: False}, "bundles": {0: ALIVE, 1: DEAD}, "reads": 0}

    def table(pg):
        state["reads"] += 1
        if state["reads"] == 3 and "then" in state:  # Ray re-places the bundle meanwhile
            state["bundles"].update(state["then"])
            state["nodes"][SPARE] = True
        return {"bundles_to_node_id": dict(state["bundles"])}

    monkeypatch.setattr(pg_module, "placement_group_table", table)
    monkeypatch.setattr(
        ray, "nodes", lambda: [{"NodeID": n, "Alive": a} for n, a in state["nodes"].items()]
    )
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.0})
    return state


def test_placed_bundles_answer_their_nodes_at_once(cluster):
    assert ray_utils.wait_bundles_placed(object(), {3: 0}, 0.0, "CPU") == {3: ALIVE}


def test_a_bundle_on_a_dead_node_with_no_room_raises_naming_the_rank(cluster):
    # Ray still lists the bundle on the dead node (or on none, ""): either way it has no node.
    with pytest.raises(RuntimeError) as info:
        ray_utils.wait_bundles_placed(object(), {0: 0, 1: 1}, 0.0, "CPU")
    message = str(info.value)
    assert "bundle(s) [1] of rank(s) [1] have no node" in message
    assert "had a CPU for them now (0 CPUs free" in message
    cluster["bundles"][1] = ""
    with pytest.raises(RuntimeError, match=r"within 0.3 s \(VLLM_PP_PLACEMENT_TIMEOUT\)"):
        ray_utils.wait_bundles_placed(object(), {1: 1}, 0.3, "CPU")


def test_a_bundle_re_placed_within_the_wait_is_found_on_its_new_node(cluster):
    cluster["then"] = {1: SPARE}
    placed = ray_utils.wait_bundles_placed(object(), {0: 0, 1: 1}, 5.0, "CPU")
    assert placed == {0: ALIVE, 1: SPARE}
