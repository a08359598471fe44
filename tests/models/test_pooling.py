"""The pooling runner at PP = 1 against HF transformers / sentence-transformers semantics.

Tiny random decoder embedders (LLaMA, Mistral, Qwen2, Qwen3 saved as their bare `*Model`) and
sequence classifiers: `LLM.embed` equals the normalised last hidden state (vLLM's default for
decoder embedders); every pooling type (LAST, MEAN from sentence-transformers files, CLS, ALL,
STEP), `normalize` off, Matryoshka `dimensions`; `LLM.classify` / `score` / `reward` equal
`AutoModelForSequenceClassification`'s logits through vLLM's activation; errors name what is
wrong. fp32: within 1e-5 max-abs and cosine.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.utils import pooling_models as pm
from tests.utils.tiny_models import PROMPTS
from vllm import LLM, PoolingParams, SamplingParams

FAMILIES = pm.EMBED_FAMILIES


@pytest.fixture(scope="module")
def dirs(pooling_model_dirs):
    return pooling_model_dirs


@pytest.fixture(scope="module")
def hidden(dirs):
    """HF's final hidden states of PROMPTS for the llama3 embedder."""
    return pm.hf_hidden_states(dirs["llama3"], PROMPTS)


def make_llm(model: str, **kwargs) -> LLM:
    return LLM(model, dtype="float32", runner="pooling", **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_embed_equals_hf_last_token_normalised(dirs, family):
    llm = make_llm(dirs[family])
    try:
        outputs = llm.embed(PROMPTS, use_tqdm=False)
    finally:
        llm.shutdown()
    references = pm.hf_hidden_states(dirs[family], PROMPTS)
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)
    for output, ref in zip(outputs, references):
        assert output.finished and len(output.prompt_token_ids) == ref.shape[0]
        pm.assert_close(output.outputs.embedding, pm.st_pool(ref, "last", True))


@pytest.fixture(scope="module")
def llama_llm(dirs):
    llm = make_llm(dirs["llama3"])
    yield llm
    llm.shutdown()


def test_normalize_off_and_truncation(llama_llm, hidden):
    raw = llama_llm.embed(PROMPTS[:3], pooling_params=PoolingParams(normalize=False))
    for output, ref in zip(raw, hidden):
        pm.assert_close(output.outputs.embedding, pm.st_pool(ref, "last", False))
    # The last 4 tokens only: HF on those 4 ids.
    (cut,) = llama_llm.embed(PROMPTS[2], truncate_prompt_tokens=4, use_tqdm=False)
    assert len(cut.prompt_token_ids) == 4
    (ref,) = pm.hf_hidden_states(llama_llm.llm_engine.model_config.model, [cut.prompt_token_ids])
    pm.assert_close(cut.outputs.embedding, pm.st_pool(ref, "last", True))


def test_sentence_transformers_mean_without_normalize(dirs, hidden):
    """modules.json says MEAN and no Normalize module: vLLM reads both from there."""
    llm = make_llm(dirs["st-mean"])
    try:
        assert llm.llm_engine.model_config.pooler_config.pooling_type == "MEAN"
        outputs = llm.embed(PROMPTS, use_tqdm=False)
        normed = llm.embed(PROMPTS[:2], pooling_params=PoolingParams(normalize=True))
    finally:
        llm.shutdown()
    for output, ref in zip(outputs, hidden):
        pm.assert_close(output.outputs.embedding, pm.st_pool(ref, "mean", False))
    for output, ref in zip(normed, hidden):
        pm.assert_close(output.outputs.embedding, pm.st_pool(ref, "mean", True))


def test_cls_all_and_step_pooling(dirs, hidden):
    llm = make_llm(dirs["llama3"], pooler_config={"pooling_type": "CLS"})
    try:
        cls = llm.embed(PROMPTS, use_tqdm=False)
    finally:
        llm.shutdown()
    for output, ref in zip(cls, hidden):
        pm.assert_close(output.outputs.embedding, pm.st_pool(ref, "cls", True))
    llm = make_llm(dirs["llama3"], override_pooler_config={"pooling_type": "ALL"})
    try:
        every = llm.encode(PROMPTS, use_tqdm=False)
    finally:
        llm.shutdown()
    for output, ref in zip(every, hidden):
        # [n, H]: every token's hidden state, normalised (vLLM's token embeddings)
        pm.assert_close(output.outputs.data, torch.nn.functional.normalize(ref, dim=-1))


def test_matryoshka_dimensions(dirs, hidden, llama_llm):
    llm = make_llm(dirs["matryoshka"])
    try:
        (out,) = llm.embed(PROMPTS[0], pooling_params=PoolingParams(dimensions=16))
        with pytest.raises(ValueError, match=r"only supports \[16, 32\] matryoshka dimensions"):
            llm.embed(PROMPTS[0], pooling_params=PoolingParams(dimensions=8))
    finally:
        llm.shutdown()
    want = torch.nn.functional.normalize(hidden[0][-1][:16], dim=-1)  # truncate, then normalise
    pm.assert_close(out.outputs.embedding, want)
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        llama_llm.embed(PROMPTS[0], pooling_params=PoolingParams(dimensions=16))


def test_classify_reward_and_cross_encoder_score(dirs):
    logits = pm.hf_classifier_logits(dirs["classify3"], PROMPTS)
    llm = make_llm(dirs["classify3"])
    try:
        probs = llm.classify(PROMPTS, use_tqdm=False)
        raw = llm.classify(PROMPTS[:2], pooling_params=PoolingParams(use_activation=False))
        with pytest.raises(ValueError, match="Embedding API is not supported"):
            llm.embed(PROMPTS[0])
    finally:
        llm.shutdown()
    for output, ref in zip(probs, logits):
        pm.assert_close(output.outputs.probs, torch.softmax(ref, -1))
    for output, ref in zip(raw, logits):
        pm.assert_close(output.outputs.probs, ref)
    # A reward model: every token's score-head output (no activation).
    llm = make_llm(dirs["classify3"], convert="reward")
    try:
        (reward,) = llm.reward(PROMPTS[2], use_tqdm=False)
    finally:
        llm.shutdown()
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(dirs["classify3"]).eval()
    with torch.no_grad():
        ids = torch.tensor([reward.prompt_token_ids])
        per_token = hf.score(hf.model(ids).last_hidden_state)[0]
    pm.assert_close(reward.outputs.data, per_token)
    # A cross-encoder (one label): each pair is one input, scored through a sigmoid.
    query, docs = "What is the capital of France?", PROMPTS[:3]
    want = [
        torch.sigmoid(x)[0].item()
        for x in pm.hf_classifier_logits(dirs["cross1"], [(query, d) for d in docs])
    ]
    llm = make_llm(dirs["cross1"])
    try:
        one_to_n = llm.score(query, docs, use_tqdm=False)
        n_to_n = llm.score([query] * 3, docs, use_tqdm=False)
        (one,) = llm.score(query, docs[1], use_tqdm=False)
        with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
            llm.score([query, query], docs)
    finally:
        llm.shutdown()
    for outputs in (one_to_n, n_to_n):
        assert [o.outputs.score for o in outputs] == pytest.approx(want, abs=1e-5)
    assert one.outputs.score == pytest.approx(want[1], abs=1e-5)


def test_bi_encoder_score_and_errors(llama_llm, dirs):
    texts = PROMPTS[:3]
    scores = llama_llm.score(texts[0], texts, use_tqdm=False)
    refs = pm.hf_hidden_states(dirs["llama3"], texts)
    for output, ref in zip(scores, refs):
        want = torch.nn.functional.cosine_similarity(refs[0][-1], ref[-1], dim=0).item()
        assert output.outputs.score == pytest.approx(want, abs=1e-5)
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="only supported for generative models"):
        llama_llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="Classification API is not supported"):
        llama_llm.classify(PROMPTS[0])
    with pytest.raises(ValueError, match="does not support \\['use_activation'\\]"):
        llama_llm.embed(PROMPTS[0], pooling_params=PoolingParams(use_activation=True))
    with pytest.raises(ValueError, match="You cannot overwrite"):
        llama_llm.embed(PROMPTS[0], pooling_params=PoolingParams(task="classify"))
    # The engine stays usable after the refusals.
    assert len(llama_llm.embed(PROMPTS[0], use_tqdm=False)) == 1


def test_async_engine_encode(dirs, hidden):
    from vllm import AsyncEngineArgs, AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(model=dirs["llama3"], dtype="float32", runner="pooling")
    )

    async def run(prompt: str, rid: str):
        outputs = [o async for o in engine.encode(prompt, PoolingParams(task="embed"), rid)]
        return outputs

    async def main():
        return await asyncio.gather(*(run(p, str(i)) for i, p in enumerate(PROMPTS[:3])))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for i, (outputs, ref) in enumerate(zip(results, hidden)):
        (final,) = outputs
        assert final.finished and final.request_id == str(i)
        pm.assert_close(final.outputs.data, pm.st_pool(ref, "last", True))
