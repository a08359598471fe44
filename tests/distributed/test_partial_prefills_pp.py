"""vLLM's concurrent partial prefills end to end at PP=2 (mp): with max_num_partial_prefills=2
and max_long_partial_prefills=1, short prompts behind a long one start first, two prompts share
each micro-batch's budget, and the greedy tokens of every prompt equal HF's."""

from __future__ import annotations

import random
from typing import Any

from tests.utils import tiny_models
from vllm import LLM, SamplingParams

KIND = "llama-gqa-untied"
NEW_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

_rng = random.Random(40)
# max_model_len 512: long_prefill_token_threshold defaults to int(512 * 0.04) = 20 tokens.
LENGTHS = {"long-a": 160, "long-b": 96, "short-c": 8, "long-d": 64, "short-e": 12}
PROMPTS = {rid: [_rng.randrange(100, 49000) for _ in range(n)] for rid, n in LENGTHS.items()}


def test_short_prompts_pass_long_ones_and_tokens_equal_hf(tiny_model_dirs) -> None:
    model = tiny_models.load_hf(tiny_model_dirs[KIND])
    expected = tiny_models.hf_greedy_ids(model, list(PROMPTS.values()), NEW_TOKENS)
    del model
    llm = LLM(
        tiny_model_dirs[KIND],
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_partial_prefills=2,
        max_long_partial_prefills=1,
        max_num_seqs=8,
        disable_log_stats=True,
    )
    try:
        scheduler = llm.llm_engine.scheduler
        assert scheduler.scheduler_config.long_prefill_token_threshold == 20
        schedule = scheduler.schedule
        first_step: dict[str, int] = {}
        shared: list[int] = []  # steps where two prompts prefilled side by side

        def recording_schedule(step_no: int = 0) -> Any:
            records, out = schedule(step_no)
            prefills = [g.request_id for g in out.scheduled_seq_groups if g.is_prefill()]
            if len(prefills) > 1:
                shared.append(step_no)
            for group in out.scheduled_seq_groups:
                first_step.setdefault(group.request_id, step_no)
            return records, out

        scheduler.schedule = recording_schedule  # type: ignore[method-assign]
        try:
            for rid, prompt in PROMPTS.items():
                llm.llm_engine.add_request(rid, prompt_token_ids=prompt, sampling_params=GREEDY)
            outputs: dict[str, list[int]] = {}
            while llm.llm_engine.has_unfinished_requests():
                for output in llm.llm_engine.step():
                    if output.finished:
                        outputs[output.request_id] = list(output.outputs[0].token_ids)
        finally:
            del scheduler.schedule
        assert [outputs[rid] for rid in PROMPTS] == expected
        # The short prompts started before the long ones queued ahead of them.
        assert first_step["short-c"] < first_step["long-b"], first_step
        assert first_step["short-e"] < first_step["long-d"], first_step
        assert shared
    finally:
        llm.shutdown()
