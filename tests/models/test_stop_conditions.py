"""Stop conditions in vLLM's order, each against a result computed independently from HF's
greedy continuation and the tokenizer: EOS (and ignore_eos), stop_token_ids, stop strings
across token boundaries (with and without include_stop_str_in_output), min_tokens, length,
and the streaming hold-back of possible stop-string prefixes."""

from __future__ import annotations

import pytest
import torch

from tests.utils import tiny_models
from vllm import LLM, SamplingParams

KIND = "opt-pre"
PROMPT = tiny_models.PROMPTS[5]
MAX = 24


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    engine = LLM(tiny_model_dirs[KIND], kv_cache_space=0.05, swap_space=0.01)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_model_dirs):
    return tiny_models.load_hf(tiny_model_dirs[KIND])


@pytest.fixture(scope="module")
def greedy(tiny_model_dirs) -> list[int]:
    """HF's greedy continuation (no stop conditions)."""
    return tiny_models.hf_greedy(tiny_model_dirs[KIND], [PROMPT], MAX)[0]


def run(llm: LLM, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=kwargs.pop("max_tokens", MAX), **kwargs)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def decode(llm: LLM, ids: list[int]) -> str:
    return llm.get_tokenizer().decode(ids, skip_special_tokens=True)


def test_length(llm, greedy):
    out = run(llm, max_tokens=7)
    assert out.token_ids == greedy[:7] and out.finish_reason == "length"
    assert out.stop_reason is None and out.text == decode(llm, greedy[:7])


def test_stop_token_ids(llm, greedy):
    k = next(i for i in range(2, MAX) if greedy[i] not in greedy[:i])
    stop = greedy[k]
    out = run(llm, stop_token_ids=[stop])
    assert out.token_ids == greedy[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    # As in vLLM, the stop token's text is dropped unless include_stop_str_in_output.
    assert out.text == decode(llm, greedy[:k])
    kept = run(llm, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert kept.token_ids == greedy[: k + 1] and kept.text == decode(llm, greedy[: k + 1])


def _straddling_stop_string(llm, greedy) -> tuple[str, int]:
    """A stop string spanning two tokens' texts, and the index of the token completing it."""
    texts = [decode(llm, greedy[: i + 1]) for i in range(MAX)]
    for j in range(2, MAX - 1):
        a, b = texts[j - 1], texts[j]
        if len(b) - len(a) >= 2 and len(a) - len(texts[j - 2]) >= 2:
            candidate = a[-2:] + b[len(a) : len(a) + 2]
            first = texts[-1].find(candidate)
            end = first + len(candidate)
            done = next(i for i, t in enumerate(texts) if len(t) >= end)
            if first >= 0 and done == j:
                return candidate, j
    raise AssertionError("no straddling stop string in the greedy text")


def test_stop_string_across_tokens(llm, greedy):
    stop, j = _straddling_stop_string(llm, greedy)
    full = decode(llm, greedy)
    index = full.find(stop)
    out = run(llm, stop=["never-seen-xyz", stop])
    assert out.token_ids == greedy[: j + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == full[:index]
    kept = run(llm, stop=stop, include_stop_str_in_output=True)
    assert kept.token_ids == greedy[: j + 1] and kept.text == full[: index + len(stop)]


def test_stop_token_checked_before_stop_string(llm, greedy):
    k = next(
        i
        for i in range(1, MAX)
        if greedy[i] not in greedy[:i]
        and len(decode(llm, [greedy[i]]).strip()) >= 2
        and decode(llm, [greedy[i]]).strip() not in decode(llm, greedy[:i])
    )
    text = decode(llm, [greedy[k]]).strip()
    out = run(llm, stop=[text], stop_token_ids=[greedy[k]])
    assert out.token_ids == greedy[: k + 1] and out.stop_reason == greedy[k]


def _force_eos_at(positions: set[int], eos: int):
    def processor(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) in positions:
            logits[eos] = 1e4
        return logits

    return processor


def test_eos_ignore_eos_and_min_tokens(llm, greedy):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    out = run(llm, logits_processors=[_force_eos_at({3}, eos)])
    assert out.token_ids == greedy[:3] + [eos]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.text == decode(llm, greedy[:3])
    # With special tokens rendered, the EOS text is still removed unless asked for.
    shown = run(llm, logits_processors=[_force_eos_at({3}, eos)], skip_special_tokens=False)
    assert shown.text == decode(llm, greedy[:3])
    for spaces, sep in ((True, " "), (False, "")):
        kept = run(
            llm,
            logits_processors=[_force_eos_at({3}, eos)],
            skip_special_tokens=False,
            include_stop_str_in_output=True,
            spaces_between_special_tokens=spaces,
        )
        assert kept.text == decode(llm, greedy[:3]) + sep + tok.eos_token
    ignored = run(llm, logits_processors=[_force_eos_at({3}, eos)], ignore_eos=True, max_tokens=6)
    assert ignored.token_ids[:4] == greedy[:3] + [eos] and ignored.finish_reason == "length"
    # min_tokens: the EOS cannot even be sampled before 5 tokens, so the greedy text goes on.
    late = run(llm, logits_processors=[_force_eos_at({3, 6}, eos)], min_tokens=5)
    assert late.token_ids == greedy[:6] + [eos] and late.finish_reason == "stop"


def test_min_tokens_with_stop_token_matches_hf(llm, hf, greedy):
    stop = greedy[1]
    eos = llm.get_tokenizer().eos_token_id
    ids = llm.get_tokenizer().encode(PROMPT)
    with torch.no_grad():
        t = torch.tensor([ids])
        ref = hf.generate(
            t,
            attention_mask=torch.ones_like(t),
            do_sample=False,
            max_new_tokens=MAX,
            min_new_tokens=5,
            eos_token_id=[stop, eos],
            pad_token_id=hf.config.pad_token_id,
        )[0, len(ids) :].tolist()
    if stop in ref[5:]:
        ref = ref[: ref.index(stop, 5) + 1]
    out = run(llm, stop_token_ids=[stop], min_tokens=5)
    assert out.token_ids == ref and ref != greedy[: len(ref)]
    assert out.finish_reason == ("stop" if ref[-1] == stop else "length")


def test_streaming_holds_back_possible_stop_prefix(llm, greedy):
    engine = llm.llm_engine
    stop = "never-seen-xyz"  # 14 chars: up to 13 may be a stop-string prefix
    engine.add_request("stream", PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=stop))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append((len(out.outputs[0].token_ids), out.outputs[0].text, out.finished))
    for count, text, finished in seen:
        full = decode(llm, greedy[:count])
        assert text == (full if finished else full[: max(len(full) - 13, 0)])
    assert seen[-1][2] and seen[-1][1] == decode(llm, greedy[:12])


def test_detokenize_false_still_stops_on_tokens(llm, greedy):
    out = run(llm, detokenize=False, stop_token_ids=[greedy[4]], max_tokens=10)
    first = greedy.index(greedy[4])
    assert out.token_ids == greedy[: first + 1] and out.text == ""
