"""Pipeline parallelism over Ray: PP = 2, 3, 4 (even and uneven splits) give HF's greedy output
exactly, also under preemption; KV blocks scale with the stage count; bad sizes fail fast."""

from __future__ import annotations

import time

import pytest

from tests.utils import tiny_models
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def run_and_compare(llm: LLM, reference: list[list[int]]) -> None:
    outputs = llm.generate(tiny_models.PROMPTS, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref, f"prompt {out.prompt!r}"
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


@pytest.mark.parametrize(
    "kind,pp,partition",
    [
        # opt-pre at PP=2: test_stage_actors_freeze_their_startup_objects_and_die_on_shutdown;
        # llama-gqa-untied at PP=2: test_async_pipeline.py (Ray, the same engine arguments).
        ("opt-post", 2, None),
        ("llama-gqa-tied", 2, None),
        ("opt-post", 3, None),
        ("llama-gqa-tied", 3, None),
        ("opt-pre", 4, None),  # 6 layers on 4 stages: 2/2/1/1
        ("llama-gqa-untied", 4, None),
        ("llama-gqa-tied", 2, "1,5"),  # user-given uneven split
    ],
)
def test_pp_matches_hf(kind, pp, partition, ray_session, tiny_model_dirs, hf_reference):
    llm = LLM(
        tiny_model_dirs[kind],
        pipeline_parallel_size=pp,
        pp_layer_partition=partition,
        kv_cache_space=0.05,
        swap_space=0.01,
    )
    assert_contiguous_layers(llm, partition)
    run_and_compare(llm, hf_reference(kind))
    llm.shutdown()


def assert_contiguous_layers(llm: LLM, partition: str | None) -> None:
    infos = llm.llm_engine.get_stage_infos()
    ranges = [i.layers for i in infos if i.layers]
    assert ranges[0][0] == 0 and ranges[-1][1] == 6
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    if partition:
        assert [e - s for s, e in ranges] == [1, 5]


@pytest.mark.parametrize("kind,mode", [("llama-gqa-untied", "recompute"), ("opt-post", "swap")])
def test_pp_under_preemption(kind, mode, ray_session, tiny_model_dirs, hf_reference):
    llm = LLM(
        tiny_model_dirs[kind],
        pipeline_parallel_size=2,
        num_gpu_blocks_override=12,
        max_model_len=192,
        swap_space=0.01,
        preemption_mode=mode,
    )
    run_and_compare(llm, hf_reference(kind))
    assert llm.llm_engine.scheduler.num_cumulative_preemption > 0
    llm.shutdown()


def test_kv_blocks_scale_with_stages(tmp_path, tiny_model_dirs):
    # 12 layers split evenly over 1, 2, 3 and 4 stages; same per-stage budget. Without the
    # boundary cache (stage_recovery="full") the blocks scale with the stages exactly. (On
    # mp: the sizing is the Worker's on either backend -- test_tensor_parallel.py checks the
    # per-rank blocks on Ray too -- and six Ray engines took ~50 s.)
    tok_dir = tiny_model_dirs["llama-gqa-tied"]
    model_dir = tiny_models.build_model("llama-gqa-tied", str(tmp_path / "m12"), tok_dir, 12)
    blocks, params, with_boundary = {}, {}, {}
    kw = dict(kv_cache_space=0.05, swap_space=0.01)
    for pp in (1, 2, 3, 4):
        backend = "mp" if pp > 1 else None
        llm = LLM(
            model_dir,
            pipeline_parallel_size=pp,
            distributed_executor_backend=backend,
            stage_recovery="full",
            **kw,
        )
        blocks[pp] = llm.llm_engine.cache_config.num_gpu_blocks
        params[pp] = [i.num_params for i in llm.llm_engine.get_stage_infos()]
        llm.shutdown()
    for pp in (2, 3, 4):
        assert abs(blocks[pp] / blocks[1] - pp) / pp < 0.05, blocks
    # Each middle stage holds ~1/N of the decoder weights and no embeddings.
    assert params[4][1] * 4 < params[1][0]
    # With the boundary cache (the default at PP > 1) a non-last stage also keeps one hidden
    # row (64 values) per token next to its KV (2 x 2 KV heads x 16 x 12/PP layers): the
    # blocks shrink by exactly that share, as the README states.
    for pp in (2, 4):
        llm = LLM(model_dir, pipeline_parallel_size=pp, distributed_executor_backend="mp", **kw)
        with_boundary[pp] = llm.llm_engine.cache_config.num_gpu_blocks
        llm.shutdown()
        kv_values = 2 * 2 * 16 * (12 // pp)
        expected = blocks[pp] * kv_values / (kv_values + 64)
        assert abs(with_boundary[pp] / expected - 1) < 0.02, (with_boundary, blocks)


def test_pp_size_errors_are_prompt(ray_session, tiny_model_dirs):
    path = tiny_model_dirs["opt-pre"]
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(path, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(7\) must not exceed"):
        LLM(path, pipeline_parallel_size=7)
    with pytest.raises(ValueError, match="pp_layer_partition"):
        LLM(path, pipeline_parallel_size=2, pp_layer_partition="2,2")
    # 5 ranks on a 4-CPU Ray instance: refused at once, not a hang.
    start = time.monotonic()
    with pytest.raises(ValueError, match="exceeds the total number of available CPUs"):
        LLM(path, pipeline_parallel_size=5, kv_cache_space=0.05)
    assert time.monotonic() - start < 30


def test_stage_actors_freeze_their_startup_objects_and_die_on_shutdown(
    ray_session, tiny_model_dirs, hf_reference
):
    """Also opt-pre's row of test_pp_matches_hf (PP=2, the even split): the same engine."""
    import ray

    llm = LLM(
        tiny_model_dirs["opt-pre"], pipeline_parallel_size=2, kv_cache_space=0.05, swap_space=0.01
    )
    workers = list(llm.llm_engine.executor.workers)
    assert ray.get([w.get_node_ip.remote() for w in workers])
    # Out of the cyclic GC after initialize_cache: torch, the model, the cache (>10k objects).
    assert min(ray.get([w.gc_frozen_objects.remote() for w in workers])) > 10_000
    assert_contiguous_layers(llm, None)
    run_and_compare(llm, hf_reference("opt-pre"))
    llm.shutdown()
    for w in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(w.get_node_ip.remote(), timeout=30)
