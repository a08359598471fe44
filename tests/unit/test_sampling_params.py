"""SamplingParams: vLLM's defaults, normalisation, validation messages, clone and pickling."""

from __future__ import annotations

import pickle
import sys

import pytest

from vllm.sampling_params import SamplingParams, SamplingParamsTypeError, SamplingType

# Torch-free unit tests: part of `make test-fast`.
pytestmark = pytest.mark.fast


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    expected = dict(
        n=1, best_of=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
        temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, use_beam_search=False,
        length_penalty=1.0, early_stopping=False, stop=[], stop_token_ids=[],
        include_stop_str_in_output=False, ignore_eos=False, max_tokens=16, min_tokens=0,
        logprobs=None, prompt_logprobs=None, detokenize=True, skip_special_tokens=True,
        spaces_between_special_tokens=True, logits_processors=None, truncate_prompt_tokens=None,
        output_text_buffer_length=0,
    )  # fmt: skip
    assert {k: getattr(p, k) for k in expected} == expected
    assert p.all_stop_token_ids == set()
    assert p.sampling_type == SamplingType.RANDOM


def test_positional_order_matches_vllm() -> None:
    p = SamplingParams(2, 3, 0.1, 0.2, 1.1, 0.7, 0.9, 5, 0.05, 42)
    assert (p.n, p.best_of, p.presence_penalty, p.frequency_penalty) == (2, 3, 0.1, 0.2)
    assert (p.repetition_penalty, p.temperature, p.top_p, p.top_k) == (1.1, 0.7, 0.9, 5)
    assert (p.min_p, p.seed) == (0.05, 42)


def test_does_not_import_torch() -> None:
    import subprocess

    code = "import sys, vllm.sampling_params; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, r"n must be at least 1, got 0\."),
        ({"n": 2, "best_of": 1},
         r"best_of must be greater than or equal to n, got n=2 and best_of=1"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2\.5"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be in \(0, 2\], got 0"),
        ({"repetition_penalty": 2.5}, r"repetition_penalty must be in \(0, 2\]"),
        ({"temperature": -0.1}, r"temperature must be non-negative, got -0\.1"),
        ({"temperature": float("nan")}, r"temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, r"top_k must be -1 \(disable\), or at least 1, got 0\."),
        ({"top_k": -2}, r"top_k must be -1 \(disable\), or at least 1"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1\.5"),
        ({"max_tokens": 0}, r"max_tokens must be at least 1, got 0\."),
        ({"min_tokens": -1}, r"min_tokens must be greater than or equal to 0, got -1\."),
        ({"min_tokens": 5, "max_tokens": 4},
         r"min_tokens must be less than or equal to max_tokens=4, got 5\."),
        ({"logprobs": -1}, r"logprobs must be non-negative, got -1\."),
        ({"prompt_logprobs": -1}, r"prompt_logprobs must be non-negative, got -1\."),
        ({"truncate_prompt_tokens": 0}, r"truncate_prompt_tokens must be >= 1, got 0"),
        ({"stop": ["a", ""]}, r"stop cannot contain an empty string\."),
        ({"stop": "x", "detokenize": False},
         r"stop strings are only supported when detokenize is True\. Set detokenize=True"),
        # beam search
        ({"use_beam_search": True, "temperature": 0},
         r"best_of must be greater than 1 when using beam search\. Got 1\."),
        ({"use_beam_search": True, "best_of": 2},
         r"temperature must be 0 when using beam search\."),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0, "top_p": 0.5},
         r"top_p must be 1 when using beam search\."),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0, "top_k": 3},
         r"top_k must be -1 when using beam search\."),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0, "early_stopping": "always"},
         r"early_stopping must be True, False, or 'never', got always\."),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0, "length_penalty": float("inf")},
         r"length_penalty must be a finite number"),
        # non-beam
        ({"early_stopping": True},
         r"early_stopping is not effective and must be False when not using beam search\."),
        ({"early_stopping": "never"}, r"early_stopping is not effective"),
        ({"length_penalty": 0.5},
         r"length_penalty is not effective and must be the default value of 1\.0 "
         r"when not using beam search\."),
        # greedy
        ({"temperature": 0, "n": 2}, r"best_of must be 1 when using greedy sampling\. Got 2\."),
        ({"temperature": 1e-6, "best_of": 3}, r"best_of must be 1 when using greedy sampling"),
    ],
)  # fmt: skip
def test_invalid_values_raise_vllm_messages(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 2.0}, "n"), ({"n": "2"}, "n"), ({"n": True}, "n"), ({"best_of": 1.5}, "best_of"),
        ({"max_tokens": 16.0}, "max_tokens"), ({"max_tokens": "16"}, "max_tokens"),
        ({"min_tokens": None}, "min_tokens"), ({"top_k": 5.0}, "top_k"), ({"seed": "1"}, "seed"),
        ({"temperature": "0.5"}, "temperature"), ({"top_p": None}, "top_p"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
        ({"ignore_eos": "False"}, "ignore_eos"), ({"stop": [1]}, "stop"), ({"stop": 3}, "stop"),
        ({"stop_token_ids": 2}, "stop_token_ids"), ({"stop_token_ids": ["2"]}, "stop_token_ids"),
        ({"logits_processors": [1]}, "logits_processors"),
    ],
)  # fmt: skip
def test_wrong_types_name_the_parameter(kwargs: dict, name: str) -> None:
    # Catchable as either exception: vLLM raises ValueError for n but TypeError for top_k.
    for exc in (TypeError, ValueError, SamplingParamsTypeError):
        with pytest.raises(exc, match=rf"^{name} must be"):
            SamplingParams(**kwargs)


def test_stop_normalisation_and_buffer_length() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=["a", "abcd"]).output_text_buffer_length == 3
    kept = SamplingParams(stop="abcd", include_stop_str_in_output=True)
    assert kept.output_text_buffer_length == 0
    assert SamplingParams().output_text_buffer_length == 0


def test_stop_token_ids_and_all_stop_token_ids() -> None:
    ids = (7, 8)
    p = SamplingParams(stop_token_ids=ids)
    assert p.stop_token_ids == [7, 8] and isinstance(p.stop_token_ids, list)
    assert p.all_stop_token_ids == {7, 8}
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_scalar_normalisation() -> None:
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=0).seed == 0
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(logprobs=5).logprobs == 5
    assert SamplingParams(n=3).best_of == 3
    assert SamplingParams(max_tokens=None).max_tokens is None
    p = SamplingParams(temperature=1)
    assert p.temperature == 1.0 and isinstance(p.temperature, float)


def test_greedy_resets_filters() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.8).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.8, seed=1).sampling_type == SamplingType.RANDOM_SEED
    beam = SamplingParams(use_beam_search=True, best_of=4, temperature=0, early_stopping="never")
    assert beam.sampling_type == SamplingType.BEAM
    assert [t.value for t in SamplingType] == [0, 1, 2, 3]


def test_beam_search_accepts_length_penalty_and_early_stopping() -> None:
    p = SamplingParams(n=2, use_beam_search=True, temperature=0, length_penalty=0.5,
                       early_stopping=True)  # fmt: skip
    assert (p.best_of, p.length_penalty, p.early_stopping) == (2, 0.5, True)


def test_update_from_generation_config() -> None:
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_generation_config({"eos_token_id": [2, 3]}, model_eos_token_id=2)
    assert sorted(p.stop_token_ids) == [3, 5]
    assert p.all_stop_token_ids == {2, 3, 5}

    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 9}, model_eos_token_id=2)
    assert q.stop_token_ids == [] and q.all_stop_token_ids == {2, 9}

    r = SamplingParams()
    r.update_from_generation_config({}, model_eos_token_id=2)
    assert r.stop_token_ids == [] and r.all_stop_token_ids == {2}


def test_clone_shares_processors_and_copies_lists() -> None:
    def proc(token_ids: list[int], logits: object) -> object:
        return logits

    p = SamplingParams(stop=["x"], stop_token_ids=[1], logits_processors=[proc])
    c = p.clone()
    assert c == p and c is not p
    assert c.logits_processors[0] is proc
    assert c.logits_processors is not p.logits_processors
    c.stop.append("y")
    c.stop_token_ids.append(2)
    c.all_stop_token_ids.add(3)
    assert p.stop == ["x"] and p.stop_token_ids == [1] and p.all_stop_token_ids == {1}


def test_pickle_round_trip() -> None:
    p = SamplingParams(n=2, temperature=0.7, seed=3, stop="end", logprobs=True, max_tokens=None)
    assert p.sampling_type == SamplingType.RANDOM_SEED  # cached value must survive too
    q = pickle.loads(pickle.dumps(p))
    assert q == p
    assert q.all_stop_token_ids == p.all_stop_token_ids
    assert q.output_text_buffer_length == 2
    assert q.sampling_type == SamplingType.RANDOM_SEED


def test_repr_lists_vllm_fields() -> None:
    text = repr(SamplingParams(stop="a"))
    assert text.startswith("SamplingParams(n=1, best_of=1, presence_penalty=0.0, ")
    assert "early_stopping=False, stop=['a'], stop_token_ids=[], " in text
    assert text.endswith("spaces_between_special_tokens=True, truncate_prompt_tokens=None)")
