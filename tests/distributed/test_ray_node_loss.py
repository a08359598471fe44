"""A whole Ray node leaves a (simulated) multi-node cluster in the middle of a generation.

Each test runs a script in a fresh process with its own `ray.cluster_utils.Cluster`: a head
with no CPU (the driver's node, which never holds a stage) and 1-CPU nodes. Removing a node
kills every process on it, Ray's placement-group bundles there included.

- The engine (PP=2, one stage per node, a spare node): the node of stage 1 leaves -> the stage
  comes back on the spare node (its bundle re-placed there); then the node of stage 0 leaves
  and no node has room -> the pipeline shrinks to PP=1 at once (no wait for the restart
  deadline); growing back fails at once while no node has room (growing back onto bundles
  with a node again is test_pipeline_shrink's). Every generation equals the fault-free one
  (and HF's), every failure names the lost stage's rank, layers, pid and node.
- Ray Data (`build_processor`, one instance on a 1-CPU node, a spare node): that node -- the
  instance's actor and its engine -- leaves during `map_batches`; the actor restarts in its
  group, re-placed on the spare node, the batch is retried, and the job completes with every
  row answered once, as without the loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Stages are killed and replaced here: engines keep a warm spare, as in production (conftest).
WARM_SPARES = True

pytestmark = pytest.mark.ray

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLUSTER = """
import json, sys, time
import ray
from ray.cluster_utils import Cluster

MB = 2**20
cluster = Cluster(
    initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 * MB}
)
nodes = {}

def add_node(num_cpus=1):
    node = cluster.add_node(num_cpus=num_cpus, object_store_memory=80 * MB)
    nodes[node.node_id] = node
    return node.node_id

def remove_node(node_id):
    cluster.remove_node(nodes.pop(node_id))
"""

ENGINE_SCRIPT = CLUSTER + textwrap.dedent(
    """
    from tests.utils import tiny_models
    from tests.utils.faults import after_steps, token_ids
    from vllm import LLM, SamplingParams

    for _ in range(3):  # two stages and a spare
        add_node()
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    prompts = tiny_models.PROMPTS * 3
    params = SamplingParams(temperature=0, max_tokens=32)
    llm = LLM(sys.argv[1], pipeline_parallel_size=2, kv_cache_space=0.05, swap_space=0.01,
              disable_log_stats=True)
    engine = llm.llm_engine
    executor = engine.executor
    out = {"reference": token_ids(llm.generate(prompts, params, use_tqdm=False)), "rounds": []}

    def lose_node_of(rank):
        before = engine.get_stage_infos()[rank]
        lost = before.node_id
        events = len(engine.fault_events)
        thread = after_steps(llm, 4, lambda: remove_node(lost))
        started = time.monotonic()
        got = token_ids(llm.generate(prompts, params, use_tqdm=False))
        thread.join(timeout=60)
        new_events = engine.fault_events[events:]
        out["rounds"].append({
            "lost_node": lost, "lost_pid": before.pid, "lost_layers": list(before.layers),
            "equal": got == out["reference"], "seconds": time.monotonic() - started,
            "events": [(e.ranks, e.message, e.detected_after_s) for e in new_events],
            "pp": engine.parallel_config.pipeline_parallel_size,
            "node_ids": list(executor.node_ids), "alive": sorted(nodes),
        })

    lose_node_of(1)  # the spare node takes stage 1
    lose_node_of(0)  # no node has room: stage 1 takes stage 0's layers, PP=1
    out["resizes"] = [(e.reason, e.old_pp, e.new_pp) for e in engine.resilience.resizes.events]
    started = time.monotonic()
    out["grew_without_room"] = engine.grow_pipeline()
    out["grow_without_room_s"] = time.monotonic() - started
    llm.shutdown()
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(out))
    """
)


DATA_SCRIPT = CLUSTER + textwrap.dedent(
    """
    import ray.data
    from ray.util.placement_group import placement_group_table
    from tests.utils import tiny_models
    from vllm import LLM, SamplingParams
    from vllm.batch import build_processor

    for _ in range(2):  # the instance's node (its one-stage engine) and a spare
        add_node(num_cpus=1)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    prompts = [f"{tiny_models.PROMPTS[i % 4]} {i}" for i in range(int(sys.argv[2]))]
    greedy = {"temperature": 0.0, "max_tokens": 12}
    engine = {"kv_cache_space": 0.05, "swap_space": 0.01}
    dataset = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    rows, lost = [], []
    with build_processor(
        sys.argv[1], num_instances=1, pipeline_parallel_size=1, batch_size=4,
        sampling_params=greedy, engine_kwargs=engine, device="cpu",
    ) as processor:
        for batch in processor(dataset).iter_batches(batch_size=None, batch_format="pandas"):
            rows.extend(batch.to_dict("records"))
            if not lost:
                # The first rows are back, the next batches are running: the node of the
                # instance (its actor and both stages, in its group) leaves.
                [group] = processor.placement_groups
                lost.append(placement_group_table(group)["bundles_to_node_id"][0])
                remove_node(lost[0])
        group = placement_group_table(processor.placement_groups[0])
    single = LLM(sys.argv[1], **engine)
    reference = [o.outputs[0].text for o in single.generate(
        prompts, SamplingParams(**greedy), use_tqdm=False)]
    single.shutdown()
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps({
        "ids": sorted(r["id"] for r in rows),
        "errors": [r["error"] for r in rows if r["error"]],
        "equal": all(r["generated_text"] == reference[r["id"]] for r in rows),
        "lost": lost, "group_nodes": list(group["bundles_to_node_id"].values()),
        "alive": sorted(nodes),
    }))
    """
)


def _run(script: str, args: list[str], env: dict[str, str], timeout: int = 600) -> dict:
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _check_named(event: tuple, rank: int, round_: dict) -> None:
    ranks, message, detected_after_s = event
    assert ranks == [rank], event
    start, end = round_["lost_layers"]
    assert f"rank {rank}, layers [{start}, {end})" in message, message
    assert f"pid {round_['lost_pid']}" in message, message
    assert f"id {round_['lost_node'][:12]}" in message, message
    # A dead stage is seen through Ray / its heartbeat, well within the step deadline.
    assert detected_after_s < 10, event


def test_stage_node_leaves_the_cluster(tiny_model_dirs, hf_reference):
    kind = "llama-gqa-tied"
    result = _run(
        ENGINE_SCRIPT,
        [tiny_model_dirs[kind]],
        # The restart deadline stays at its default (180 s): a stage with no node to go to
        # must leave after the bundle's placement wait (5 s; Ray re-places a bundle in well
        # under a second when a node has room), not after that.
        {"VLLM_PP_PLACEMENT_TIMEOUT": "5", "VLLM_PP_REGROW_INTERVAL_S": "600"},
    )
    assert result["reference"] == hf_reference(kind) * 3
    moved, shrunk = result["rounds"]

    # Stage 1's node left: the stage came back on the spare node, nothing lost.
    assert moved["equal"] and moved["pp"] == 2
    [event] = moved["events"]
    _check_named(event, 1, moved)
    assert moved["lost_node"] not in moved["node_ids"]
    assert set(moved["node_ids"]) == set(moved["alive"]), moved

    # Stage 0's node left and no node had room: PP=1 on the node left, nothing lost, and
    # without waiting for the 180 s restart deadline.
    assert shrunk["equal"] and shrunk["pp"] == 1
    [event] = shrunk["events"]
    _check_named(event, 0, shrunk)
    assert shrunk["node_ids"] == shrunk["alive"]
    assert shrunk["seconds"] < 90, shrunk["seconds"]
    assert result["resizes"] == [["shrink", 2, 1]]

    # Growing back with no room fails at once (the engine goes on at PP=1). Growing back onto
    # bundles that have a node again is tests/distributed/test_pipeline_shrink.py's.
    assert result["grew_without_room"] is False
    assert result["grow_without_room_s"] < 10


def test_ray_data_instance_node_leaves_the_cluster(tiny_model_dirs):
    num_rows = 24
    result = _run(
        DATA_SCRIPT,
        [tiny_model_dirs["llama-gqa-tied"], str(num_rows)],
        {},
    )
    [lost] = result["lost"]
    assert lost, "the instance's actor was not found"
    # Every row answered exactly once, without an error, as without the loss.
    assert result["ids"] == list(range(num_rows))
    assert result["errors"] == []
    assert result["equal"]
    # The instance's group moved off the lost node, onto nodes still there.
    assert lost not in result["group_nodes"]
    assert set(result["group_nodes"]) <= set(result["alive"]), result
