"""Speculative decoding, engine side (no torch): `speculative_config` checks, prompt lookup,
the planner's caps and pauses, and the lookahead slots of a verify step."""

from __future__ import annotations

import json
import random
import re

import pytest

from tests.utils.fake_requests import FakeParams
from tests.utils.fake_requests import seq_ids as _seq_ids
from vllm.core.block_manager import BlockSpaceManager
from vllm.engine.arg_utils import EngineArgs
from vllm.sequence import Logprob, Sequence, SequenceGroup
from vllm.spec_decode.config import SpeculativeConfig
from vllm.spec_decode.ngram import propose_ngram
from vllm.spec_decode.planner import DraftPlanner, SpecOutcome

pytestmark = pytest.mark.fast

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


def test_config_forms_and_refusals() -> None:
    config = SpeculativeConfig.from_user(NGRAM)
    assert config == SpeculativeConfig("ngram", 3, 4, 4, None)
    # The command line's JSON text, and vLLM 0.5's keywords, mean the same.
    assert SpeculativeConfig.from_user(json.dumps(NGRAM)) == config
    legacy = EngineArgs(
        speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=4
    )
    assert legacy._speculative_config() == config
    assert SpeculativeConfig.from_user({"model": "[ngram]", "num_speculative_tokens": 2}) == (
        SpeculativeConfig("ngram", 2, 5, 5, None)
    )
    draft = SpeculativeConfig.from_user({"model": "smollm2", "num_speculative_tokens": 3})
    assert draft is not None and (draft.method, draft.model) == ("draft_model", "smollm2")
    refused = {
        "unknown key(s) ['lookahead']": {**NGRAM, "lookahead": 2},
        "num_speculative_tokens must be provided": {"method": "ngram"},
        "num_speculative_tokens must be > 0": {**NGRAM, "num_speculative_tokens": 0},
        "prompt_lookup_min=5 must be <= prompt_lookup_max=4": {**NGRAM, "prompt_lookup_min": 5},
        "is not supported by this engine yet": {"method": "eagle", "num_speculative_tokens": 2},
        "needs 'model'": {"method": "draft_model", "num_speculative_tokens": 2},
        "only 1 is supported": {
            "model": "d",
            "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": 2,
        },
        "unknown method 'medusa2'": {"method": "medusa2", "num_speculative_tokens": 2},
        "disable_by_batch_size": {**NGRAM, "disable_by_batch_size": 1},
        "not valid JSON": "{method: ngram}",
    }
    for message, value in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            SpeculativeConfig.from_user(value)
    with pytest.raises(TypeError, match="must be an int"):
        SpeculativeConfig.from_user({**NGRAM, "num_speculative_tokens": "3"})
    both = EngineArgs(speculative_config=NGRAM, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="were both given"):
        both._speculative_config()


def _reference_lookup(tokens: list[int], k: int, most: int, least: int) -> list[int]:
    """The definition, by brute force: the latest earlier occurrence of the longest suffix,
    copied on (overlapping) from after it."""
    for n in range(min(most, len(tokens) - 1), least - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                out = list(tokens)
                for i in range(k):
                    out.append(out[start + n + i])
                return out[len(tokens) :]
    return []


def test_prompt_lookup_matches_its_definition() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        # Ids whose bytes overlap across neighbours (256, 65536...) must not match inside
        # two ids: the search runs over the ids' bytes.
        tokens = [
            rng.randrange(4) * rng.choice([1, 256, 65536]) for _ in range(rng.randrange(1, 40))
        ]
        args = (tokens, rng.randrange(1, 6), rng.randrange(1, 5), 1)
        assert propose_ngram(*args) == _reference_lookup(*args), args
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 3, 1) == [3, 4, 1]
    assert propose_ngram([7, 5, 5], 4, 1, 1) == [5, 5, 5, 5]  # repetition goes on
    assert propose_ngram([9, 1, 2, 7, 1, 2], 2, 2, 2) == [7, 1]
    assert propose_ngram([1, 2, 3], 2, 2, 1) == []


def _group(prompt: list[int], params: FakeParams) -> tuple[SequenceGroup, Sequence]:
    seq = Sequence(next(_seq_ids), "p", prompt, block_size=4)
    return SequenceGroup(str(seq.seq_id), [seq], params, arrival_time=0.0), seq  # type: ignore[arg-type]


class _Params(FakeParams):
    structured_outputs = None


def test_planner_caps_and_pauses() -> None:
    planner = DraftPlanner(SpeculativeConfig.from_user(NGRAM), max_model_len=64)  # type: ignore[arg-type]
    repeating = [1, 2, 3, 4] * 4
    group, seq = _group(repeating, _Params(max_tokens=16))
    assert planner.drafts_for(group, seq) == [1, 2, 3]
    # k + 1 tokens may come back: never past max_tokens ...
    group, seq = _group(repeating, _Params(max_tokens=3))
    assert planner.drafts_for(group, seq) == [1, 2]
    group, seq = _group(repeating, _Params(max_tokens=1))
    assert planner.drafts_for(group, seq) == []
    # ... nor past the context window.
    group, seq = _group([1, 2, 3, 4] * 15 + [1, 2], _Params(max_tokens=None))
    assert planner.drafts_for(group, seq) == [3, 4]
    group, seq = _group(repeating, _Params(use_beam_search=True))
    assert planner.drafts_for(group, seq) == []
    # vLLM's disable_by_batch_size, and a pause while drafts are rarely accepted.
    small = DraftPlanner(SpeculativeConfig.from_user({**NGRAM, "disable_by_batch_size": 4}), 64)  # type: ignore[arg-type]
    assert small.begin_step(4) and not small.begin_step(5) and small.begin_step(3)
    # Without disable_by_batch_size: paused above the default (a compute-bound batch).
    assert planner.begin_step(16) and not planner.begin_step(17) and planner.begin_step(1)
    planner.observe(SpecOutcome(100, 300, 3, [3, 0, 0]))
    assert not planner.begin_step(1)
    assert planner.totals.num_draft_tokens == 300 and planner.totals.accepted_per_pos == [3, 0, 0]


def test_lookahead_slots_copy_every_shared_block_written() -> None:
    """A verify step writes positions len-1 .. len-1+k: each shared block among them (a
    forked sibling's, including blocks an earlier verify left past the end) gets a private
    copy, and only those."""
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=32, num_cpu_blocks=0)
    group, seq = _group(list(range(6)), _Params())
    bm.allocate(group)
    assert bm.lookahead_cost(seq, 5) == 1 and bm.append_slots(seq, 5) == []
    assert len(bm.get_block_table(seq)) == 3  # positions 5 .. 10
    seq.append_token_id(9, {9: Logprob(0.0)})  # one token accepted: the table reaches past it
    child = seq.fork(next(_seq_ids))
    group.add(child)
    bm.fork(seq, child)
    shared = bm.get_block_table(seq)
    assert bm.lookahead_cost(seq, 4) == 2  # blocks 1 and 2 (positions 6 .. 10) are shared
    pairs = bm.append_slots(seq, 4)
    assert [src for src, _ in pairs] == shared[1:3]
    assert bm.get_block_table(seq)[0] == shared[0]  # not written: still shared
    assert bm.get_block_table(child) == shared
