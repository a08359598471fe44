"""Batch inference over Ray Data (vllm.batch): N instances x PP stages, per-row failures.

One dataset run per layout on the session's Ray instance (4 CPUs): 2 instances x PP=1 (two
1-CPU groups) and 1 instance x PP=2 (one 2-CPU group, whose bundles the engine must use
instead of creating a second group). Every row must come back exactly once with the greedy
text `LLM.generate` gives for the same prompt.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ray.data")

from tests.utils import tiny_models  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.batch import (  # noqa: E402
    LLMPredictor,
    build_processor,
    read_dataset,
    read_outputs,
    write_dataset,
)

MODEL = "llama-gqa-tied"
NUM_ROWS = 60
MAX_TOKENS = 12
ENGINE = dict(kv_cache_space=0.05, swap_space=0.01)
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}


def _prompts() -> list[str]:
    base = tiny_models.PROMPTS
    return [f"{base[i % len(base)]} {i}" for i in range(NUM_ROWS)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return tiny_model_dirs[MODEL]


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, tuple[str, int, int, str]]:
    """prompt -> (text, prompt tokens, generated tokens, finish reason) from LLM.generate."""
    llm = LLM(model_dir, **ENGINE)
    outputs = llm.generate(_prompts(), SamplingParams(**GREEDY), use_tqdm=False)
    llm.shutdown()
    return {
        o.prompt: (
            o.outputs[0].text,
            len(o.prompt_token_ids),
            len(o.outputs[0].token_ids),
            o.outputs[0].finish_reason,
        )
        for o in outputs
    }


def _run(ray, model_dir, out_path, num_instances, pp):
    """One Ray Data run through the package; returns (output DataFrame, groups it created)."""
    import ray.data

    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(_prompts())])

    def job():
        with build_processor(
            model_dir,
            num_instances=num_instances,
            pipeline_parallel_size=pp,
            batch_size=8,
            sampling_params=GREEDY,
            engine_kwargs=ENGINE,
            device="cpu",
        ) as processor:
            write_dataset(processor(ds), str(out_path))

    created = _groups_created_by(job)
    return read_outputs(str(out_path)), created


def _groups_created_by(job):
    """Run `job`; the placement groups it created, checked to be removed when it returns."""
    from ray.util import placement_group_table

    before = set(placement_group_table())
    job()
    table = placement_group_table()
    created = [pg_id for pg_id in table if pg_id not in before]
    assert all(table[pg_id]["state"] == "REMOVED" for pg_id in created), "groups left behind"
    return created


def _run_example(model_dir, tmp_path, num_instances):
    """The same run through examples/ray_data_batch_inference.py, from a JSONL file."""
    import importlib.util
    import json
    import os
    import sys

    path = os.path.join(
        os.path.dirname(__file__), "..", "..", "examples", "ray_data_batch_inference.py"
    )
    spec = importlib.util.spec_from_file_location("ray_data_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    source = tmp_path / "prompts.jsonl"
    source.write_text(
        "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(_prompts()))
    )
    out = tmp_path / "out.parquet"
    argv = [
        "--input",
        str(source),
        "--output",
        str(out),
        "--model",
        model_dir,
        "--num-instances",
        str(num_instances),
        "--batch-size",
        "8",
        "--temperature",
        "0",
        "--max-tokens",
        str(MAX_TOKENS),
        "--kv-cache-space",
        "0.05",
        "--swap-space",
        "0.01",
        "--device",
        "cpu",
    ]
    saved = sys.argv
    sys.argv = ["ray_data_batch_inference.py", *argv]
    try:
        created = _groups_created_by(lambda: example.run(example.parse_args()))
    finally:
        sys.argv = saved
    return read_outputs(str(out)), created


def _check(df, reference):
    assert sorted(df["id"].tolist()) == list(range(NUM_ROWS)), "each row exactly once"
    prompts = _prompts()
    for row in df.itertuples():
        assert row.prompt == prompts[row.id]
        assert row.error == ""
        text, n_prompt, n_gen, finish = reference[row.prompt]
        assert row.generated_text == text, row.id
        assert (row.num_prompt_tokens, row.num_generated_tokens) == (n_prompt, n_gen)
        assert row.finish_reason == finish


def test_two_instances_pp1(ray_session, model_dir, reference, tmp_path):
    # Through the example script (JSONL in, Parquet out), as a user runs it.
    df, created = _run_example(model_dir, tmp_path, 2)
    _check(df, reference)
    assert len(created) == 2  # one group per instance


def test_one_instance_pp2(ray_session, model_dir, reference, tmp_path):
    # Needs the engine to use the instance's placement group (no second group of 2 CPUs).
    df, created = _run(ray_session, model_dir, tmp_path / "out.jsonl", 1, 2)
    _check(df, reference)
    assert len(created) == 1, f"the engine created a group of its own: {created}"


# -- LLMPredictor alone (in this process, PP=1): per-row failures, chat template ---------------


@pytest.fixture(scope="module")
def predictor(model_dir) -> LLMPredictor:
    pred = LLMPredictor(model_dir, sampling_params=GREEDY, engine_kwargs=ENGINE)
    yield pred
    pred.shutdown()


def test_row_failures_are_reported_per_row(predictor, reference):
    import numpy as np

    good = _prompts()[3]
    too_long = "hello " * 600  # beyond the tiny model's 512-token context
    batch = {
        "prompt": np.array([good, None, good, too_long, good, good], dtype=object),
        "sampling_params": np.array(
            [None, None, {"temperature": -1.0}, None, {"max_tokens": 3}, {"logprobs": 50}],
            dtype=object,
        ),
    }
    out = predictor(batch)
    assert list(out["prompt"][:1]) == [good]
    assert out["generated_text"][0] == reference[good][0] and out["error"][0] == ""
    assert "no text in column 'prompt'" in out["error"][1]
    assert "temperature" in out["error"][2] and out["generated_text"][2] == ""
    assert "too long" in out["error"][3] and out["finish_reason"][3] == "length"
    assert out["error"][4] == "" and out["num_generated_tokens"][4] == 3
    assert out["finish_reason"][4] == "length"
    # Refused by the engine (not by SamplingParams): found by splitting the batch.
    assert "logprobs of 50" in out["error"][5] and out["generated_text"][5] == ""


def test_engine_failure_fails_the_batch_only(predictor, reference, monkeypatch):
    import numpy as np

    from vllm.resilience.errors import EngineDeadError

    prompts = _prompts()[:3]
    broken = predictor.llm

    def dead(*args, **kwargs):
        raise EngineDeadError("stage 1 (rank 1) died")

    monkeypatch.setattr(broken, "generate", dead)
    out = predictor({"prompt": np.array(prompts, dtype=object)})
    assert all(e.startswith("engine failed: EngineDeadError") for e in out["error"])
    assert predictor.llm is None
    out = predictor({"prompt": np.array(prompts, dtype=object)})  # a new LLM is built
    assert list(out["error"]) == ["", "", ""]
    assert list(out["generated_text"]) == [reference[p][0] for p in prompts]


def test_chat_template_matches_llm_chat(predictor):
    import pandas as pd

    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    want = predictor.llm.chat(conversation, SamplingParams(**GREEDY), use_tqdm=False)[0]
    batch = pd.DataFrame({"messages": [conversation], "tag": ["x"]})
    out = predictor(batch)
    assert out["generated_text"][0] == want.outputs[0].text
    assert out["prompt"][0] == want.prompt and out["tag"][0] == "x"


def test_read_dataset_formats(ray_session, tmp_path):
    import json

    import pandas as pd

    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    with open(tmp_path / "p.jsonl", "w") as f:
        for i, p in enumerate(["a", "b"]):
            f.write(json.dumps({"id": i, "prompt": p}) + "\n")
    pd.DataFrame({"prompt": ["x", "y", "z"]}).to_parquet(tmp_path / "p.parquet")
    assert sorted(r["prompt"] for r in read_dataset(str(tmp_path / "p.txt")).take_all()) == [
        "first prompt",
        "second prompt",
    ]
    assert read_dataset(str(tmp_path / "p.jsonl")).count() == 2
    assert read_dataset(str(tmp_path / "p.parquet")).columns() == ["prompt"]
    with pytest.raises(ValueError, match="unknown input format"):
        read_dataset(str(tmp_path / "p.csv"))


def test_ray_data_llm_gap_is_stated_by_code():
    """`python -m vllm.batch.ray_llm_compat` lists what ray.data.llm's vLLM stage calls; the
    async-engine calls are reported missing exactly when this vllm has no AsyncLLMEngine."""
    import vllm
    from vllm.batch import ray_llm_compat

    results = {r.call: r for r in ray_llm_compat.check()}
    assert all(isinstance(r.ok, bool) and r.needed_for for r in results.values())
    has_async = hasattr(vllm, "AsyncLLMEngine")
    assert results["AsyncLLMEngine.shutdown()"].ok == has_async
    missing = ray_llm_compat.missing_required()
    assert all(r.required and not r.ok for r in missing)
    assert bool(missing) or has_async


def test_instance_bundles_per_layout():
    from vllm.batch import BatchProcessor, instance_bundles

    assert instance_bundles(2, 1) == [{"CPU": 1}, {"CPU": 1}]
    assert instance_bundles(1, 3, use_gpu=True) == [{"GPU": 1, "CPU": 1}] * 3
    gpu = BatchProcessor("m", pipeline_parallel_size=2, tensor_parallel_size=2, device="cuda")
    assert gpu.bundles == [{"GPU": 1, "CPU": 1}] * 4
    assert gpu.predictor_kwargs["engine_kwargs"]["distributed_executor_backend"] == "ray"
    cpu = BatchProcessor("m", device="cpu")
    assert cpu.bundles == [{"CPU": 1}] and cpu.predictor_kwargs["engine_kwargs"]["device"] == "cpu"
    with pytest.raises(ValueError, match="num_instances"):
        BatchProcessor("m", num_instances=0, device="cpu")
