"""Chunked pipelining end to end: several chunks of one long prompt inside the pipeline at once
(on different stages, in order). Greedy tokens equal HF's for prompts split into many chunks at
PP 2 and 4 with prefix caching and preemption; a stage killed while three chunks of one prompt
are in flight loses nothing."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.utils import tiny_models
from tests.utils.faults import kill_before_a_step
from vllm import LLM, SamplingParams

KIND = "llama-gqa-untied"
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

_rng = random.Random(4096)
SYSTEM = [_rng.randrange(100, 49000) for _ in range(96)]
# Long prompts (many chunks each) sharing a prefix, so prefix caching has blocks to hit.
PROMPTS = [SYSTEM + [_rng.randrange(100, 49000) for _ in range(n)] for n in (380, 250, 150, 31)]


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dirs) -> list[list[int]]:
    model = tiny_models.load_hf(tiny_model_dirs[KIND])
    return tiny_models.hf_greedy_ids(model, PROMPTS, NEW_TOKENS)


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


class _ChunksInFlight:
    """Counts, over the scheduler's steps, the most chunks of one prompt in the pipeline at
    once (the chunk scheduled plus those still in flight ahead of it)."""

    def __init__(self, llm: LLM) -> None:
        self.most = 0
        self.scheduler = llm.llm_engine.scheduler
        self.schedule = self.scheduler.schedule

        def schedule(step_no: int = 0) -> Any:
            records, out = self.schedule(step_no)
            for group in out.scheduled_seq_groups:
                if group.request_id in out.chunk_offsets:
                    self.most = max(self.most, len(group.flights))
            return records, out

        self.scheduler.schedule = schedule  # type: ignore[method-assign]

    def close(self) -> None:
        del self.scheduler.schedule


@pytest.fixture(scope="module", params=[2, 4], ids=lambda pp: f"mp-pp{pp}")
def engine(request, tiny_model_dirs) -> Iterator[LLM]:
    llm = LLM(
        tiny_model_dirs[KIND],
        pipeline_parallel_size=request.param,
        distributed_executor_backend="mp",
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        # 32 tokens a round: each micro-batch carries a chunk of 32 / PP tokens.
        max_num_batched_tokens=32,
        max_num_seqs=8,
        block_size=16,
        # Fewer blocks than the four prompts and their outputs need at once: preemption.
        num_gpu_blocks_override=60,
        swap_space=0.05,
        disable_log_stats=True,
    )
    yield llm
    llm.shutdown()


def test_long_prompts_in_many_chunks_equal_hf(engine, hf_greedy) -> None:
    counter = _ChunksInFlight(engine)
    try:
        assert _generate(engine) == hf_greedy
        # Again, with the shared prefix cached.
        hits = engine.llm_engine.scheduler.block_manager.num_hit_blocks
        assert _generate(engine) == hf_greedy
    finally:
        counter.close()
    scheduler = engine.llm_engine.scheduler
    assert scheduler.block_manager.num_hit_blocks > hits
    assert scheduler.num_cumulative_preemption > 0
    pp = engine.llm_engine.parallel_config.pipeline_parallel_size
    # Every stage had a chunk of one prompt at once (async scheduling: up to 2 x PP).
    assert counter.most >= pp, counter.most


def test_a_stage_killed_with_three_chunks_of_one_prompt_in_flight(
    tiny_model_dirs, hf_greedy
) -> None:
    llm = LLM(
        tiny_model_dirs[KIND],
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        disable_log_stats=True,
    )
    try:

        def third_chunk_behind(out: Any) -> bool:
            # Three chunks of one prompt already in flight when this one is submitted.
            return any(len(g.flights) >= 4 for g in out.scheduled_seq_groups)

        events = len(llm.llm_engine.fault_events)
        with kill_before_a_step(llm, 1, third_chunk_behind) as fired:
            outputs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert fired, "no step was scheduled behind three chunks of one prompt"
        assert [list(outputs[0].outputs[0].token_ids)] == hf_greedy[:1]
        (event,) = llm.llm_engine.fault_events[events:]
        assert event.stage_recovery == "local", event.as_dict()
    finally:
        llm.shutdown()
