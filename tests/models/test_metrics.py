"""Engine metrics in the offline engine: vLLM's Prometheus names (the shape of vLLM's own
preemption test), the periodic throughput line, and nothing collected when stats are off."""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY

from tests.utils import tiny_models
from vllm import LLM, SamplingParams
from vllm.engine.metrics import StatLoggerBase, Stats, format_log_line

KIND = "llama-gqa-untied"


def samples(name: str) -> float:
    total = 0.0
    for family in REGISTRY.collect():
        if family.name == name:
            total += sum(s.value for s in family.samples)
    return total


def histogram(name: str) -> tuple[float, float]:
    """(count, sum) of a histogram."""
    found = {}
    for family in REGISTRY.collect():
        if family.name == name:
            for s in family.samples:
                found[s.name] = found.get(s.name, 0.0) + s.value
    return found.get(name + "_count", 0.0), found.get(name + "_sum", 0.0)


def test_preemptions_and_tokens_counted(tiny_model_dirs, caplog):
    llm = LLM(
        tiny_model_dirs[KIND],
        num_gpu_blocks_override=12,
        max_model_len=192,
        swap_space=0.01,
        preemption_mode="recompute",
        disable_log_stats=False,
    )
    for stat_logger in llm.llm_engine.stat_loggers.values():
        stat_logger.local_interval = 0.0  # log every step
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


class Recorder(StatLoggerBase):
    """A user's stat logger, as vLLM's tests write them."""

    def __init__(self) -> None:
        super().__init__(local_interval=0.0)
        self.seen: list[Stats] = []

    def log(self, stats: Stats) -> None:
        self.seen.append(stats)

    def info(self, type: str, obj: object) -> None:
        pass


def test_request_params_cache_config_and_added_loggers(tiny_model_dirs):
    llm = LLM(tiny_model_dirs[KIND], kv_cache_space=0.02, swap_space=0.01, disable_log_stats=False)
    engine = llm.llm_engine
    assert set(engine.stat_loggers) == {"logging", "prometheus"}
    # vLLM's tests read the collectors by its attribute names, with the logger's labels.
    prometheus = engine.stat_loggers["prometheus"]
    prompt_counter = prometheus.metrics.counter_prompt_tokens.labels(**prometheus.labels)
    assert prompt_counter._value.get() == 0
    recorder = Recorder()
    engine.add_logger("mine", recorder)
    try:
        engine.add_logger("mine", Recorder())
        raise AssertionError("a second logger under one name was accepted")
    except KeyError as exc:
        assert "already exists" in str(exc)
    params = [SamplingParams(n=2, best_of=3, temperature=1.0, seed=1, max_tokens=4)] + [
        SamplingParams(temperature=0, max_tokens=4)
    ] * 2
    outs = llm.generate(tiny_models.PROMPTS[:3], params, use_tqdm=False)
    # vLLM's names: a histogram each, one observation per finished request.
    assert histogram("vllm:request_params_n") == (3, 2 + 1 + 1)
    assert histogram("vllm:request_params_best_of") == (3, 3 + 1 + 1)
    info = [
        s
        for family in REGISTRY.collect()
        if family.name == "vllm:cache_config_info"
        for s in family.samples
    ]
    assert len(info) == 1 and info[0].value == 1.0
    assert info[0].labels["block_size"] == str(engine.cache_config.block_size)
    assert info[0].labels["num_gpu_blocks"] == str(engine.cache_config.num_gpu_blocks)
    # The added logger saw the same stats, under vLLM's field names too.
    finished = [n for s in recorder.seen for n in s.n_requests]
    assert sorted(finished) == [1, 1, 2]
    assert prompt_counter._value.get() == sum(len(o.prompt_token_ids) for o in outs)
    # best_of=3 samples 3 sequences: every sampled token counts (as in vLLM).
    assert sum(s.num_generation_tokens_iter for s in recorder.seen) == 3 * 4 + 2 * 4
    engine.remove_logger("mine")
    count = len(recorder.seen)
    llm.generate("A", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(recorder.seen) == count
    try:
        engine.remove_logger("mine")
        raise AssertionError("removing a missing logger passed")
    except KeyError as exc:
        assert "does not exist" in str(exc)
    llm.shutdown()


def test_added_logger_turns_stats_on(tiny_model_dirs):
    llm = LLM(tiny_model_dirs[KIND], kv_cache_space=0.02, swap_space=0.01)
    assert llm.llm_engine.stats is None
    try:
        llm.llm_engine.stat_loggers  # noqa: B018 - vLLM's test reads it for the error
        raise AssertionError("stat_loggers exists with stats off")
    except AttributeError:
        pass
    recorder = Recorder()
    llm.llm_engine.add_logger("mine", recorder)
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert sum(s.num_generation_tokens for s in recorder.seen) == 3
    llm.shutdown()


def test_prefix_cache_hit_rate_gauge(tiny_model_dirs):
    def gauge() -> float:
        return samples("vllm:gpu_prefix_cache_hit_rate")

    llm = LLM(
        tiny_model_dirs[KIND],
        kv_cache_space=0.02,
        swap_space=0.01,
        enable_prefix_caching=True,
        disable_log_stats=False,
    )
    prompt = tiny_models.PROMPTS[7]  # several full blocks
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert gauge() == 0.0
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    rate = llm.llm_engine.scheduler.block_manager.get_prefix_cache_hit_rate()
    assert rate > 0 and gauge() == rate
    llm.shutdown()
    off = LLM(tiny_model_dirs[KIND], kv_cache_space=0.02, swap_space=0.01, disable_log_stats=False)
    off.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert gauge() == -1.0  # as vLLM reports it with prefix caching off
    off.shutdown()
