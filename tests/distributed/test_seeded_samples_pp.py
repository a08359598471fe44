"""Seeded n > 1 does not depend on the pipeline depth when the samples of a request end at
different steps: at PP=2 with async scheduling (mp) a step scheduled ahead still carries a
sample that has just finished, so the live samples of the group differ from PP=1's for a step.
Each sample draws from its own seeded stream (keyed by its index in the group, as vLLM's
seed + index), never from its position among the live rows, so the tokens are identical.
"""

from __future__ import annotations

import json

import jsonschema

from tests.utils import tiny_models
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams

KIND = "llama-gqa-untied"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 4},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


def _requests(vocab_size: int) -> tuple[list[str], list[SamplingParams]]:
    # One id in five stops a sample: on a tiny random model (a nearly flat distribution at
    # temperature 1) the three samples of a request end at scattered lengths.
    stops = list(range(7, vocab_size, 5))
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    prompts, params = [], []
    for i, seed in enumerate((3, 11, 29)):
        prompts.append(tiny_models.PROMPTS[i])
        params.append(
            SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=30, stop_token_ids=stops)
        )
        prompts.append(tiny_models.PROMPTS[i + 3])
        params.append(
            SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=80, structured_outputs=so)
        )
    return prompts, params


def _ids(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def test_seeded_n3_same_tokens_at_pp2_async(tiny_model_dirs):
    path = tiny_model_dirs[KIND]
    single = LLM(path, kv_cache_space=0.05, swap_space=0.01)
    try:
        prompts, params = _requests(len(single.get_tokenizer()))
        expected = single.generate(prompts, params, use_tqdm=False)
        # vLLM's parallel sampling seeds sample k with seed + k: the k-th sample of the first
        # request equals an n=1 request seeded 3 + k.
        stops = params[0].stop_token_ids
        singles = [
            SamplingParams(temperature=1.0, seed=3 + k, max_tokens=30, stop_token_ids=stops)
            for k in range(3)
        ]
        alone = single.generate([prompts[0]] * 3, singles, use_tqdm=False)
    finally:
        single.shutdown()
    # The test is only meaningful when siblings end at different steps.
    uneven = [len({len(c.token_ids) for c in o.outputs}) > 1 for o in expected]
    assert any(uneven[0::2]) and any(uneven[1::2]), _ids(expected)
    # (as sets: the outputs of a request are ordered by their scores, not by index)
    assert sorted(list(o.outputs[0].token_ids) for o in alone) == sorted(_ids(expected)[0])
    for out in expected[1::2]:
        for comp in out.outputs:
            assert comp.finish_reason == "stop", comp.text
            jsonschema.validate(json.loads(comp.text, strict=False), SCHEMA)

    pp2 = LLM(
        path,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        kv_cache_space=0.05,
        swap_space=0.01,
    )
    try:
        assert pp2.llm_engine.batch_queue.async_pipeline
        got = pp2.generate(prompts, params, use_tqdm=False)
    finally:
        pp2.shutdown()
    assert _ids(got) == _ids(expected)
    assert [[c.text for c in o.outputs] for o in got] == [
        [c.text for c in o.outputs] for o in expected
    ]
