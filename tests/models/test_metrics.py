"""Engine metrics in the offline engine: vLLM's Prometheus names (the shape of vLLM's own
preemption test), the periodic throughput line, and nothing collected when stats are off."""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY

from tests.utils import tiny_models
from vllm import LLM, SamplingParams
from vllm.engine.metrics import Stats, format_log_line

KIND = "llama-gqa-untied"


def samples(name: str) -> float:
    total = 0.0
    for family in REGISTRY.collect():
        if family.name == name:
            total += sum(s.value for s in family.samples)
    return total


def test_preemptions_and_tokens_counted(tiny_model_dirs, caplog):
    llm = LLM(
        tiny_model_dirs[KIND],
        num_gpu_blocks_override=12,
        max_model_len=192,
        swap_space=0.01,
        preemption_mode="recompute",
        disable_log_stats=False,
    )
    llm.llm_engine.stats.stat_logger.local_interval = 0.0  # log every step
    params = SamplingParams(temperature=0, max_tokens=32)
    with caplog.at_level(logging.INFO, logger="vllm"):
        outs = llm.generate(tiny_models.PROMPTS, params, use_tqdm=False)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_cumulative_preemption > 0
    # vLLM's test_preemption reads the counter this way.
    assert samples("vllm:num_preemptions") == scheduler.num_cumulative_preemption
    assert "is preempted by PreemptionMode.RECOMPUTE mode" in caplog.text
    assert "Avg prompt throughput:" in caplog.text and "GPU KV cache usage:" in caplog.text
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert samples("vllm:generation_tokens") == generated
    # Recompute re-prefills count as prompt tokens again (as in vLLM).
    assert samples("vllm:prompt_tokens") >= sum(len(o.prompt_token_ids) for o in outs)
    assert samples("vllm:e2e_request_latency_seconds") > 0
    assert samples("vllm:num_requests_running") == 0
    llm.shutdown()


def test_stats_off_by_default_for_llm(tiny_model_dirs):
    llm = LLM(tiny_model_dirs[KIND], kv_cache_space=0.02, swap_space=0.01)
    assert llm.llm_engine.stats is None
    llm.shutdown()


def test_log_line_wording():
    stats = Stats(
        now=0.0, num_running=3, num_waiting=2, num_swapped=1, gpu_cache_usage=0.25,
        cpu_cache_usage=0.0,
    )  # fmt: skip
    assert format_log_line(stats, 12.34, 56.78) == (
        "Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 56.8 tokens/s, "
        "Running: 3 reqs, Swapped: 1 reqs, Pending: 2 reqs, GPU KV cache usage: 25.0%, "
        "CPU KV cache usage: 0.0%."
    )
