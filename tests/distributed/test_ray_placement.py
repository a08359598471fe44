"""Ray placement like vLLM: an engine inside a Ray actor that already holds a placement group
(vLLM's Ray Data example, seed 004) runs its ranks on that group's bundles -- no second group,
no wait -- and leaves the caller's group and Ray instance alone when it shuts down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.utils import tiny_models

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ACTOR_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    model, prompts = sys.argv[1], json.loads(sys.argv[2])
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    pg = placement_group([{"CPU": 1}] * 2)  # sized for the engine: every CPU of the cluster
    ray.get(pg.ready())

    @ray.remote(num_cpus=0)
    class Predictor:
        def __init__(self):
            from vllm import LLM
            start = time.monotonic()
            self.llm = LLM(model=model, pipeline_parallel_size=2, kv_cache_space=0.05,
                           swap_space=0.01)
            self.init_s = time.monotonic() - start
            self.groups = len(placement_group_table())

        def run(self, prompts):
            from vllm import SamplingParams
            outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32),
                                     use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]

        def info(self):
            return {"init_s": self.init_s, "groups": self.groups}

        def shutdown(self):
            self.llm.shutdown()
            return ray.is_initialized()

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)
    actor = Predictor.options(scheduling_strategy=strategy).remote()
    ids = ray.get(actor.run.remote(prompts))
    info = ray.get(actor.info.remote())
    ray_up_in_actor = ray.get(actor.shutdown.remote())
    table = placement_group_table()
    pg_alive = table[pg.id.hex()]["state"] == "CREATED"
    print("RESULT " + json.dumps(dict(info, ids=ids, ray_up_in_actor=ray_up_in_actor,
                                      pg_alive=pg_alive, num_groups_after=len(table))))
    """
)


@pytest.mark.ray
def test_engine_in_actor_uses_the_current_placement_group(tiny_model_dirs, hf_reference):
    kind = "llama-gqa-untied"
    prompts = tiny_models.PROMPTS[:3]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", ACTOR_SCRIPT, tiny_model_dirs[kind], json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["ids"] == hf_reference(kind)[:3]
    assert result["groups"] == 1, "the engine created a second placement group"
    # (A second group could never be placed: the engine would have failed after
    # VLLM_PP_PLACEMENT_TIMEOUT instead of generating. No wall-time bound here: start-up time
    # on a loaded 2-core machine says nothing.)
    assert result["ray_up_in_actor"], "the engine must not shut down the caller's Ray"
    assert result["pg_alive"], "the engine must not remove the caller's placement group"


@pytest.mark.ray
def test_unplaceable_group_names_what_is_missing(ray_session, tiny_model_dirs, monkeypatch):
    from ray.util.placement_group import placement_group, remove_placement_group

    from vllm import LLM
    from vllm.executor import ray_utils

    monkeypatch.setattr(ray_utils, "_PLACEMENT_TIMEOUT_S", 2.0)
    hog = placement_group([{"CPU": 1}] * 3)  # 3 of the session's 4 CPUs
    ray_session.get(hog.ready())
    try:
        with pytest.raises(
            ValueError,
            match=r"only 1 are free \(2 CPUs are needed .* 1 CPU "
            r"missing\)",
        ):
            LLM(tiny_model_dirs["opt-pre"], pipeline_parallel_size=2, kv_cache_space=0.05)
    finally:
        remove_placement_group(hog)
