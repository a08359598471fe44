"""Bad input is refused with a clear error naming it, and the engine keeps serving the rest."""

from __future__ import annotations

import json
import logging

import pytest

from tests.utils import tiny_models
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    engine = LLM(
        tiny_model_dirs["llama-gqa-tied"], kv_cache_space=0.05, swap_space=0.01, max_model_len=64
    )
    yield engine
    engine.shutdown()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_too_long_prompt_is_reported_and_others_finish(llm, hf_reference):
    handler = _Records()
    logging.getLogger("vllm").addHandler(handler)
    try:
        long_prompt = "hello " * 100  # > max_model_len=64 tokens
        prompts = [tiny_models.PROMPTS[0], long_prompt, tiny_models.PROMPTS[1]]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    ref = hf_reference("llama-gqa-tied")
    assert outs[0].outputs[0].token_ids == ref[0]
    assert outs[2].outputs[0].token_ids == ref[1]
    ignored = outs[1].outputs[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == [] and ignored.text == ""
    assert any("is too long and exceeds limit of 64" in m for m in handler.messages)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"logprobs": 21}, ValueError, "Requested sample logprobs of 21"),
        ({"prompt_logprobs": 50}, ValueError, "Requested prompt logprobs of 50"),
    ],
)
def test_logprobs_above_max_logprobs(llm, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate("hi", SamplingParams(**kwargs), use_tqdm=False)


@pytest.mark.parametrize(
    "prompts,params,exc,match",
    [
        ([""], GREEDY, ValueError, "Prompt cannot be empty"),
        ([123], GREEDY, TypeError, "prompts must be strings or dicts"),
        ([{"prompt_token_ids": [1, 10**9]}], GREEDY, ValueError, "out-of-vocabulary"),
        ([{"prompt_token_ids": "abc"}], GREEDY, TypeError, "prompt_token_ids must be a list"),
        ([{"text": "x"}], GREEDY, ValueError, "'prompt' or 'prompt_token_ids'"),
        (["a", "b"], [GREEDY], ValueError, "lengths of prompts and sampling_params"),
        (["a"], {"temperature": 0}, TypeError, "sampling_params must be a SamplingParams"),
    ],
)
def test_bad_requests_refused_engine_keeps_serving(llm, hf_reference, prompts, params, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate(
            ["fine prompt", *prompts] if not isinstance(params, list) else prompts,
            params,
            use_tqdm=False,
        )
    # Nothing half-queued is left behind, and the next call is served normally.
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(tiny_models.PROMPTS[2], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_reference("llama-gqa-tied")[2]


def test_invalid_sampling_params_messages():
    with pytest.raises(ValueError, match="temperature must be non-negative"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="best_of must be 1 when using greedy sampling"):
        SamplingParams(temperature=0, n=2)


def test_unknown_model_path_names_it(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(missing)


def test_unsupported_architecture_names_it(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 3}, "block_size"),
        ({"gpu_memory_utilization": 1.5}, "GPU memory utilization"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"tensor_parallel_size": 3}, "must be divisible by tensor parallel size"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"max_model_len": 10**6}, "User-specified max_model_len"),
        ({"kv_cache_space": 1e-6}, "No available memory for the cache blocks"),
    ],
)
def test_bad_engine_args(tiny_model_dirs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dirs["opt-pre"], **kwargs)


def test_unknown_engine_kwarg_is_a_type_error(tiny_model_dirs):
    with pytest.raises(TypeError, match="pipeline_paralel_size"):
        LLM(tiny_model_dirs["opt-pre"], pipeline_paralel_size=2)


def test_cli_flags_use_vllm_names():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--model", "m", "-pp", "2", "--max-model-len", "128", "--kv_cache_space", "0.5"]
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.pipeline_parallel_size == 2
    assert engine_args.max_model_len == 128 and engine_args.kv_cache_space == 0.5


def test_best_of_above_max_num_seqs_is_refused(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["opt-pre"], kv_cache_space=0.05, swap_space=0.01, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"best_of \(3\) must not exceed max_num_seqs \(2\)"):
        llm.generate("hi", SamplingParams(n=1, best_of=3, temperature=1.0), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
