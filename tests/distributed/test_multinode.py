"""Real scripts in fresh processes: PP across two (simulated) Ray nodes, and an offline script
using `LLM(pipeline_parallel_size=2)` that leaves nothing running after it deletes the LLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.ray

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TWO_NODE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import ray
    from ray.cluster_utils import Cluster
    from vllm import LLM, SamplingParams

    model = sys.argv[1]
    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=16)
    single = LLM(model, kv_cache_space=0.05, swap_space=0.01)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    single.shutdown()

    # A head with no CPUs and two 1-CPU nodes: the two stages must land on different nodes.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=1)
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    llm = LLM(model, pipeline_parallel_size=2, kv_cache_space=0.05, swap_space=0.01)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    nodes = llm.llm_engine.executor.node_ids
    llm.shutdown()
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps({"nodes": nodes, "equal": got == expected}))
    """
)

OFFLINE_SCRIPT = textwrap.dedent(
    """
    import gc, json, sys
    import psutil
    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], pipeline_parallel_size=2, kv_cache_space=0.05)
    outs = llm.generate(["Hello, my name is", "The capital of France is"],
                        SamplingParams(temperature=0, max_tokens=8))
    texts = [o.outputs[0].text for o in outs]
    del llm, outs
    gc.collect()
    import ray
    children = [p.name() for p in psutil.Process().children(recursive=True) if p.is_running()]
    print("RESULT " + json.dumps({"texts": texts, "ray_up": ray.is_initialized(),
                                  "children": children}))
    """
)


def _run(script: str, model: str, timeout: int = 300) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", script, model],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_pp_across_two_ray_nodes(tiny_model_dirs):
    result = _run(TWO_NODE_SCRIPT, tiny_model_dirs["llama-gqa-untied"])
    assert result["equal"]
    assert len(set(result["nodes"])) == 2, result["nodes"]


def test_offline_script_pp2_cleans_up(tiny_model_dirs):
    result = _run(OFFLINE_SCRIPT, tiny_model_dirs["opt-post"])
    assert len(result["texts"]) == 2 and all(isinstance(t, str) for t in result["texts"])
    assert not result["ray_up"], "the engine started Ray, so deleting it must stop Ray"
    assert result["children"] == [], result["children"]
