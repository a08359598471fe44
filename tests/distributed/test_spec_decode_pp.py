"""Speculative decoding through the pipeline: greedy tokens equal HF's with prompt lookup and
with a draft model, at PP 2 and 3 on both backends (chunked prefill and prefix caching on) and
at TP 2 x PP 2; a stage SIGKILLed mid-generation with speculation on loses nothing (outputs
equal the fault-free run), and so does the draft's own rank."""

from __future__ import annotations

import os
import signal

import pytest

from tests.utils import tiny_models
from tests.utils.faults import after_steps, greedy_and_seeded, kill_stage_pid, token_ids
from vllm import LLM, SamplingParams

# Stages are killed and replaced here: engines keep a warm spare, as in production (conftest).
WARM_SPARES = True

KIND = "llama-gqa-untied"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
ENGINE = dict(
    enable_chunked_prefill=True,
    max_num_batched_tokens=64,
    max_num_seqs=16,
    enable_prefix_caching=True,
    speculative_config=SPEC,
)


def _accepted(llm: LLM) -> int:
    planner = llm.llm_engine.scheduler.draft_planner
    assert planner is not None
    return planner.totals.num_accepted_tokens


LAYOUTS = [("mp", 2, 1), ("mp", 3, 1), ("ray", 2, 1), ("ray", 3, 1), ("mp", 2, 2)]


@pytest.mark.parametrize(
    ("backend", "pp", "tp", "method"),
    [(*layout, method) for layout in LAYOUTS for method in ("ngram", "draft")],
    ids=[
        f"{b}-{'tp2-' if tp > 1 else ''}pp{pp}-{m}"
        for b, pp, tp in LAYOUTS
        for m in ("ngram", "draft")
    ],
)
def test_greedy_equals_hf(backend, pp, tp, method, tiny_model_dirs, hf_reference, request) -> None:
    """Prompt lookup and a draft model (the target's own weights, in the engine's process),
    each at PP 2 and 3 on mp and on Ray and at TP 2 x PP 2."""
    if backend == "ray":
        request.getfixturevalue("ray_session")
    model = tiny_model_dirs[KIND]
    spec = SPEC if method == "ngram" else {"model": model, "num_speculative_tokens": 3}
    llm = LLM(
        model,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        **dict(ENGINE, speculative_config=spec),
    )
    try:
        outputs = llm.generate(tiny_models.PROMPTS, GREEDY, use_tqdm=False)
        assert token_ids(outputs) == hf_reference(KIND)
        assert _accepted(llm) >= 40
    finally:
        llm.shutdown()


def test_stage_killed_mid_speculation_loses_nothing(tiny_model_dirs) -> None:
    """Greedy and seeded requests; the last stage of PP 2 is killed once drafts are being
    verified: the same tokens as the run before the kill."""
    llm = LLM(
        tiny_model_dirs[KIND],
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        max_stage_restarts=4,
        **ENGINE,
    )
    try:
        params = [
            SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
            if i % 2 == 0
            else SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True)
            for i in range(len(tiny_models.PROMPTS))
        ]
        reference = token_ids(llm.generate(tiny_models.PROMPTS, params, use_tqdm=False))
        before = _accepted(llm)
        victim: list[int] = []
        thread = after_steps(llm, 12, lambda: victim.append(kill_stage_pid(llm, 1, signal.SIGKILL)))
        outputs = token_ids(llm.generate(tiny_models.PROMPTS, params, use_tqdm=False))
        thread.join(timeout=60)
        assert victim, "the stage was never killed"
        assert llm.llm_engine.fault_events, "the kill was not seen"
        assert outputs == reference
        assert _accepted(llm) > before
    finally:
        llm.shutdown()


def test_draft_model_rank_killed_loses_nothing(tiny_model_dirs, hf_reference, monkeypatch) -> None:
    """A draft model (the target's own weights: every draft accepted) in a rank of its own,
    under PP 2 on mp: greedy tokens equal HF's, seeded samples equal across runs; its rank
    SIGKILLed mid-generation: the step goes on without drafts, the draft is rebuilt and
    drafts again, and every output equals the run before the kill."""
    monkeypatch.setenv("VLLM_SPEC_DRAFT_PLACEMENT", "rank")
    model = tiny_model_dirs[KIND]
    llm = LLM(
        model,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        **dict(ENGINE, speculative_config={"model": model, "num_speculative_tokens": 3}),
    )
    try:
        params = greedy_and_seeded(len(tiny_models.PROMPTS))
        reference = token_ids(llm.generate(tiny_models.PROMPTS, params, use_tqdm=False))
        assert reference[::2] == hf_reference(KIND)[::2]
        planner = llm.llm_engine.scheduler.draft_planner
        assert planner is not None
        proposer = planner.proposer
        assert planner.totals.num_accepted_tokens >= 40
        pid = proposer.executor.stage_infos[0].pid
        thread = after_steps(llm, 4, lambda: os.kill(pid, signal.SIGKILL))
        before = planner.totals.num_accepted_tokens
        outputs = token_ids(llm.generate(tiny_models.PROMPTS, params, use_tqdm=False))
        thread.join(timeout=60)
        assert outputs == reference
        assert proposer.rebuilds == 1 and proposer.active
        assert proposer.executor.stage_infos[0].pid != pid
        # Drafting resumed on the rebuilt draft (empty draft sequences, prefilled again).
        assert planner.totals.num_accepted_tokens > before
    finally:
        llm.shutdown()
