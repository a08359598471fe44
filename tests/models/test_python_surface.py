"""vLLM's Python surface: vllm.inputs, the legacy generate() keywords and their
DeprecationWarning, a flat list of ints as one prompt, enforce_eager, cumulative_logprob None
without logprobs, vLLM's messages, LLM.chat refusing a bare string."""

from __future__ import annotations

import warnings

import pytest

import vllm
from tests.utils import tiny_models
from vllm import LLM, SamplingParams, TextPrompt, TokensPrompt

KIND = "llama-gqa-tied"
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    engine = LLM(tiny_model_dirs[KIND], kv_cache_space=0.05, swap_space=0.01, enforce_eager=True)
    yield engine
    engine.shutdown()


def test_inputs_module_names():
    from vllm.inputs import PromptInputs, PromptStrictInputs  # noqa: F401

    assert vllm.TextPrompt is TextPrompt and vllm.TokensPrompt is TokensPrompt
    assert TextPrompt(prompt="a") == {"prompt": "a"}


def test_prompt_forms_agree(llm):
    text = tiny_models.PROMPTS[1]
    ids = llm.get_tokenizer().encode(text)
    ref = llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    forms = [
        TextPrompt(prompt=text),
        TokensPrompt(prompt_token_ids=ids),
        ids,  # a flat list of ints is one prompt
    ]
    for form in forms:
        [out] = llm.generate(form, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == ref, form
    outs = llm.generate([ids, ids[:3]], GREEDY, use_tqdm=False)
    assert len(outs) == 2 and outs[0].outputs[0].token_ids == ref
    [out] = llm.generate(inputs=TokensPrompt(prompt_token_ids=ids), sampling_params=GREEDY)
    assert out.outputs[0].token_ids == ref


def test_legacy_keywords_and_deprecation_warning(llm):
    text = tiny_models.PROMPTS[1]
    ids = llm.get_tokenizer().encode(text)
    ref = llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning outside deprecate_legacy_api()
        [a] = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)
        [b] = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)
        [c] = llm.generate(
            prompts=[text], prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False
        )
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref
    assert c.prompt == text and c.outputs[0].token_ids == ref
    with LLM.deprecate_legacy_api():
        with pytest.warns(DeprecationWarning, match="prompt_token_ids"):
            llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)
        with pytest.warns(DeprecationWarning, match="Please use the 'inputs' parameter"):
            llm.generate(prompts=text, sampling_params=GREEDY, use_tqdm=False)
    assert LLM.DEPRECATE_LEGACY is False
    with pytest.raises(ValueError, match="lengths of prompts and prompt_token_ids"):
        llm.generate(prompts=["a", "b"], prompt_token_ids=[ids], use_tqdm=False)


def test_cumulative_logprob_none_without_logprobs(llm):
    [plain] = llm.generate("Hello", GREEDY, use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None
    [asked] = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=6, logprobs=0), use_tqdm=False
    )
    comp = asked.outputs[0]
    total = sum(step[t].logprob for step, t in zip(comp.logprobs, comp.token_ids))
    assert abs(comp.cumulative_logprob - total) < 1e-4


def test_vllm_messages(llm, tiny_model_dirs):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="messages must be a list"):
        llm.chat("What is the capital of France?", GREEDY)
    no_tok = LLM(
        tiny_model_dirs[KIND], kv_cache_space=0.02, swap_space=0.01, skip_tokenizer_init=True
    )
    try:
        with pytest.raises(ValueError, match="prompts must be None if skip_tokenizer_init is True"):
            no_tok.generate("hello", GREEDY, use_tqdm=False)
        [out] = no_tok.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
        assert len(out.outputs[0].token_ids) == 3
    finally:
        no_tok.shutdown()


def test_newer_vllm_keywords_ray_data_passes():
    """Ray Data's LLM processor passes newer vLLM keywords: the harmless values are taken,
    the features this engine lacks are refused by name."""
    from vllm import AsyncEngineArgs, SamplingParams

    assert SamplingParams(structured_outputs=None).structured_outputs is None
    assert SamplingParams(structured_outputs={"json": {}}).structured_outputs.json == {}
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})
    args = AsyncEngineArgs(model="smollm2", runner="generate", enable_log_requests=False)
    assert args.runner == "generate"
    assert AsyncEngineArgs(model="smollm2", runner="pooling").runner == "pooling"
    with pytest.raises(ValueError, match="runner='pool'"):
        AsyncEngineArgs(model="smollm2", runner="pool")


def test_generate_leaves_a_host_gc_freeze_alone(llm, monkeypatch):
    """generate() unfreezes only what it froze: a host's own gc.freeze() survives it."""
    import gc

    calls = []
    real_freeze, real_unfreeze = gc.freeze, gc.unfreeze
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append("freeze"), real_freeze())[1])
    monkeypatch.setattr(gc, "unfreeze", lambda: (calls.append("unfreeze"), real_unfreeze())[1])
    assert gc.get_freeze_count() == 0
    llm.generate("Hello", GREEDY, use_tqdm=False)
    assert calls == ["freeze", "unfreeze"] and gc.get_freeze_count() == 0  # its own, undone
    calls.clear()
    real_freeze()  # the host's
    try:
        frozen = gc.get_freeze_count()
        llm.generate("Hello", GREEDY, use_tqdm=False)
        assert calls == []
        # Frozen objects that die leave the permanent generation; an unfreeze would empty it.
        assert gc.get_freeze_count() > frozen * 0.9
    finally:
        real_unfreeze()
