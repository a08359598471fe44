"""Pooling through a split pipeline (mp backend): embeddings and scores at PP = 2 and 3 and
TP = 2 equal HF transformers' (fp32, 1e-5), MEAN pooling over chunked prompts keeps every
chunk's hidden states on the last stage, and a pooling request in flight when a stage is
SIGKILLed completes with the same vector."""

from __future__ import annotations

import signal

import pytest
import torch

from tests.utils import pooling_models as pm
from tests.utils.faults import after_steps, kill_stage_pid
from tests.utils.tiny_models import PROMPTS
from vllm import LLM

# Stages are killed and replaced here: engines keep a warm spare, as in production (conftest).
WARM_SPARES = True

# Longer prompts than a step's token budget: several chunks each, interleaved across steps.
LONG = [p * 3 for p in PROMPTS]


def start(model: str, pp: int = 1, tp: int = 1, **kwargs) -> LLM:
    return LLM(
        model,
        dtype="float32",
        runner="pooling",
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
        **kwargs,
    )


@pytest.fixture(scope="module")
def mean_pp2(pooling_model_dirs):
    """sentence-transformers MEAN (not normalised) at PP = 2, 16-token chunks, prefix
    caching on (MEAN must read every position: it skips the cache)."""
    llm = start(
        pooling_model_dirs["st-mean"],
        pp=2,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        enable_prefix_caching=True,
        max_stage_restarts=4,
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def mean_reference(pooling_model_dirs):
    return [
        pm.st_pool(h, "mean", False)
        for h in pm.hf_hidden_states(pooling_model_dirs["st-mean"], LONG)
    ]


def test_mean_over_chunks_at_pp2(mean_pp2, mean_reference):
    outputs = mean_pp2.embed(LONG, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outputs) > 3 * 16  # really chunked
    for output, ref in zip(outputs, mean_reference):
        pm.assert_close(output.outputs.embedding, ref)
    # Again: the prompts' blocks are cached now, and MEAN still pools every position.
    for output, ref in zip(mean_pp2.embed(LONG, use_tqdm=False), mean_reference):
        pm.assert_close(output.outputs.embedding, ref)


@pytest.mark.parametrize("rank", [1, 0])
def test_stage_killed_mid_run_keeps_every_vector(mean_pp2, mean_reference, rank, caplog):
    """SIGKILL a stage (the last: its chunks' hidden states are lost with it; the first)
    after two steps, with chunked MEAN requests in flight: every request still returns its
    vector, equal to HF's."""
    engine = mean_pp2.llm_engine
    faults = len(engine.fault_events)
    thread = after_steps(mean_pp2, 2, lambda: kill_stage_pid(mean_pp2, rank, signal.SIGKILL))
    with caplog.at_level("INFO", logger="vllm"):
        outputs = mean_pp2.embed(LONG, use_tqdm=False)
    thread.join(timeout=60)
    assert len(engine.fault_events) == faults + 1, "the stage was not killed mid-run"
    assert len(outputs) == len(LONG)
    if rank == 1:
        # The replaced last stage lacks the earlier chunks of the prompts in progress: they
        # are recomputed (not failed, not pooled from part of the prompt).
        assert "is recomputed" in caplog.text
    for output, ref in zip(outputs, mean_reference):
        pm.assert_close(output.outputs.embedding, ref)


@pytest.mark.parametrize(
    "family, layout",
    [("mistral", {"pp": 3}), ("qwen2", {"tp": 2}), ("llama3", {"tp": 2, "pp": 2})],
    ids=["mistral-pp3", "qwen2-tp2", "llama3-tp2-pp2"],
)
def test_last_token_embeddings_split(pooling_model_dirs, family, layout):
    llm = start(pooling_model_dirs[family], **layout)
    try:
        outputs = llm.embed(PROMPTS, use_tqdm=False)
    finally:
        llm.shutdown()
    for output, ref in zip(outputs, pm.hf_hidden_states(pooling_model_dirs[family], PROMPTS)):
        pm.assert_close(output.outputs.embedding, pm.st_pool(ref, "last", True))


def test_cross_encoder_scores_at_pp2(pooling_model_dirs):
    query, docs = "Where do hobbits live?", PROMPTS
    logits = pm.hf_classifier_logits(pooling_model_dirs["cross1"], [(query, d) for d in docs])
    llm = start(pooling_model_dirs["cross1"], pp=2)
    try:
        scores = llm.score(query, docs, use_tqdm=False)
    finally:
        llm.shutdown()
    want = [torch.sigmoid(x)[0].item() for x in logits]
    assert [s.outputs.score for s in scores] == pytest.approx(want, abs=1e-5)
