"""Tensor parallelism, alone and with pipeline parallelism, on both multi-process backends:
greedy ids equal HF for tiny OPT (pre-/post-LN) and LLaMA (GQA, and one KV head replicated
over 2 ranks) at TP=2 and TP=2 x PP=2; per-rank KV sizing and weights; vLLM's validation
messages; the mp backend's failure and shutdown behaviour."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from tests.utils import tiny_models
from vllm import LLM, SamplingParams

# Stages are killed and replaced here: engines keep a warm spare, as in production (conftest).
WARM_SPARES = True

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
KV_GIB = 0.05


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, tmp_path_factory):
    """The session's tiny models plus "llama-mqa" (4 heads, 1 KV head: fewer than TP ranks)."""
    path = str(tmp_path_factory.mktemp("tp") / "llama-mqa")
    tiny_models.build_model("llama-mqa", path, tiny_model_dirs["llama-gqa-tied"])
    return dict(tiny_model_dirs, **{"llama-mqa": path})


@pytest.fixture(scope="module")
def reference(model_dirs, hf_reference):
    mqa: list = []

    def get(kind: str) -> list[list[int]]:
        if kind != "llama-mqa":
            return hf_reference(kind)
        if not mqa:
            mqa.append(tiny_models.hf_greedy(model_dirs[kind], tiny_models.PROMPTS, 32))
        return mqa[0]

    return get


def make_llm(path: str, tp: int, pp: int, backend: str, **kwargs) -> LLM:
    return LLM(
        path,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        kv_cache_space=KV_GIB,
        swap_space=0.01,
        **kwargs,
    )


def check_equal(llm: LLM, expected: list[list[int]]) -> None:
    outs = llm.generate(tiny_models.PROMPTS, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref, f"prompt {out.prompt!r}"
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


def expected_blocks(path: str, kv_heads_per_rank: int, layers: int, tp: int, pp: int) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    head = cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * 16 * kv_heads_per_rank * head * layers * 4  # K+V, 16 tokens, fp32
    if pp > 1:
        # A first stage's rank also keeps the boundary cache: per token the 1/tp slice of the
        # hidden states it sends on (stage-local recovery, on by default at PP > 1).
        block_bytes += 16 * (cfg.hidden_size // tp) * 4
    return int(KV_GIB * (1 << 30)) // block_bytes


@pytest.mark.parametrize(
    "kind,tp,pp,backend",
    [
        ("opt-pre", 2, 1, "mp"),
        ("opt-post", 2, 1, "mp"),
        ("llama-gqa-tied", 2, 1, "mp"),
        ("llama-gqa-untied", 2, 1, "mp"),
        ("llama-mqa", 2, 1, "mp"),  # 1 KV head, replicated on both ranks
        ("opt-post", 2, 2, "mp"),
        ("llama-mqa", 2, 2, "mp"),
        pytest.param("opt-pre", 2, 1, "ray", marks=pytest.mark.ray),
        pytest.param("llama-gqa-untied", 2, 1, "ray", marks=pytest.mark.ray),
        pytest.param("llama-gqa-tied", 2, 2, "ray", marks=pytest.mark.ray),
        pytest.param("opt-pre", 2, 2, "ray", marks=pytest.mark.ray),
    ],
)
def test_tp_matches_hf(kind, tp, pp, backend, model_dirs, reference, request):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    llm = make_llm(model_dirs[kind], tp, pp, backend)
    try:
        infos = llm.llm_engine.get_stage_infos()
        # vLLM's layout: rank = pp_rank * tp + tp_rank, a stage's TP ranks adjacent.
        assert [(i.pp_rank, i.tp_rank) for i in infos] == [
            (r // tp, r % tp) for r in range(tp * pp)
        ]
        check_equal(llm, reference(kind))
        # KV blocks are sized per (stage, TP rank) from the KV heads that rank keeps.
        kv_total = 1 if kind == "llama-mqa" else (2 if kind.startswith("llama") else 4)
        blocks = expected_blocks(model_dirs[kind], max(1, kv_total // tp), 6 // pp, tp, pp)
        assert llm.llm_engine.cache_config.num_gpu_blocks == blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["mp", pytest.param("ray", marks=pytest.mark.ray)])
def test_tp_pp_chunked_prefill_matches_hf(backend, model_dirs, reference, request):
    """TP=2 x PP=2 with chunked prefill (vLLM's own pipeline test rows): a micro-batch of
    prefill chunks that end before their prompts samples nothing, and only the last stage's TP
    driver may answer for it (a non-driver rank once acted as the driver and sent the step's
    sampled ids to itself: gloo "Pair is not connected"). On mp the same engine shows the
    grid: each of the 4 ranks holds ~1/4 of the weights; after shutdown no rank process (nor
    the warm spare) is left."""
    if backend == "ray":
        request.getfixturevalue("ray_session")
    kind = "llama-gqa-untied"
    llm = make_llm(
        model_dirs[kind],
        2,
        2,
        backend,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    try:
        check_equal(llm, reference(kind))
        assert not llm.llm_engine.fault_events
        infos = llm.llm_engine.get_stage_infos()
        if backend == "mp":
            executor = llm.llm_engine.executor
            pids = [p.pid for p in executor.procs] + [s.proc.pid for s in executor.spares]
            assert len(pids) == 5  # and the warm spare
    finally:
        llm.shutdown()
    if backend == "mp":
        assert_grid_weights_and_no_process_left(model_dirs[kind], infos, pids)


def assert_grid_weights_and_no_process_left(path: str, infos: list, pids: list[int]) -> None:
    """TP=2 x PP=2: each of the 4 ranks held ~1/4 of the weights; none of `pids` is left."""
    from transformers import AutoModelForCausalLM

    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    for info in infos:
        assert abs(info.num_params * 4 / total - 1) < 0.05, (info, total)
    assert not [
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
    assert not psutil.Process().children(recursive=True) or all(
        c.pid not in pids for c in psutil.Process().children(recursive=True)
    )


@pytest.mark.parametrize("tp,pp,victim_rank", [(1, 2, 1), (2, 2, 2)])
def test_mp_dead_rank_is_replaced(tp, pp, victim_rank, model_dirs, reference):
    """mp recovers like Ray: a rank killed mid-generation (a whole stage at PP=2, one TP rank
    of the last stage at TP=2 x PP=2) is replaced by the warm spare process, the groups
    re-formed with the survivors, and every request finishes with the fault-free greedy
    tokens; a new spare is started for the next failure."""
    kind = "llama-gqa-untied"
    llm = make_llm(model_dirs[kind], tp, pp, "mp", disable_log_stats=False)
    try:
        engine = llm.llm_engine
        victim = engine.executor.procs[victim_rank]
        [spare] = [s.proc for s in engine.executor.spares]
        prompts = tiny_models.PROMPTS * 2
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, GREEDY)
        finished = {}
        for _ in range(3):
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        victim.kill()
        deadline = time.monotonic() + 120
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        expected = reference(kind) * 2
        assert [list(finished[str(i)].outputs[0].token_ids) for i in range(len(prompts))] == (
            expected
        )
        assert len(engine.fault_events) == 1 and engine.fault_events[0].ranks == [victim_rank]
        assert engine.fault_events[0].recovery_s is not None
        assert not victim.is_alive()
        assert engine.executor.procs[victim_rank] is spare
        assert engine.get_stage_infos()[victim_rank].pid == spare.pid
        [next_spare] = engine.executor.spares
        assert next_spare.proc.is_alive() and next_spare.proc not in engine.executor.procs
        # The fault is counted in vLLM-style metrics.
        from prometheus_client import REGISTRY

        def sample(name: str) -> float:
            value = REGISTRY.get_sample_value(name, {"model_name": engine.served_model_name})
            assert value is not None, name
            return value

        assert sample("vllm:stage_failures_total") == 1
        assert sample("vllm:stage_recoveries_total") == 1
        assert sample("vllm:stage_recovery_seconds_count") == 1
        recomputed = engine.fault_events[0].recomputed_tokens
        assert recomputed > 0 and sample("vllm:recomputed_tokens_total") == recomputed
    finally:
        llm.shutdown()


def test_mp_rank_death_fails_fast(model_dirs):
    llm = make_llm(model_dirs["opt-pre"], 1, 2, "mp", max_stage_restarts=0)
    try:
        victim = llm.llm_engine.executor.procs[0]
        victim.kill()
        start = time.monotonic()
        # Without restarts the engine stops, naming the dead rank.
        with pytest.raises(
            RuntimeError,
            match=r"stage 0 \(rank 0, layers \[0, 3\), .*pid "
            r"\d+\) tp_rank 0: (the process died|process \d+ exited)",
        ):
            llm.generate(tiny_models.PROMPTS[:2], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in [victim])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"tensor_parallel_size": 3},
            r"Total number of attention heads \(4\) must be divisible "
            r"by tensor parallel size \(3\)\.",
        ),
        (
            {"tensor_parallel_size": 8, "swap_space": 0.01},
            r"attention heads \(4\) must be divisible",
        ),
        ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2}, "needs 'ray' or 'mp'"),
        ({"distributed_executor_backend": "nccl"}, "'ray', 'mp' or 'uni'"),
    ],
)
def test_tp_validation_is_prompt(kwargs, match, model_dirs):
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        LLM(model_dirs["opt-pre"], **kwargs)
    assert time.monotonic() - start < 10  # refused before any process starts


def test_default_backend_choice(monkeypatch):
    import importlib.util

    from vllm.config import ParallelConfig

    assert ParallelConfig(1, 1).distributed_executor_backend == "uni"
    assert ParallelConfig(2, 1).distributed_executor_backend == "ray"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    assert ParallelConfig(1, 2).distributed_executor_backend == "mp"


def test_gguf_shards_read_only_their_part():
    """Row and column shards read from the GGUF equal the same cut of the whole tensor."""
    import numpy as np

    from vllm.model_executor import gguf_loader as gl
    from vllm.model_executor.models.utils import Shard
    from vllm.transformers_utils.gguf_config import read_header, resolve_model

    path = resolve_model("smollm2")
    header = read_header(path)
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    by_name = {t.name: t for t in header.tensors}
    for name, shard in [
        ("blk.0.attn_q.weight", Shard(0, 192, 192)),
        ("blk.0.attn_output.weight", Shard(1, 192, 192)),  # whole quant blocks of columns
        ("blk.0.ffn_down.weight", Shard(1, 512, 512)),
        ("blk.0.ffn_down.weight", Shard(1, 8, 16)),  # not on block edges: cut after
        ("token_embd.weight", Shard(0, 16384, 16384)),
    ]:
        info = by_name[name]
        whole = gl._dequantize(blob, info)
        assert (gl._dequantize(blob, info, shard) == shard.narrow(whole)).all(), name


def test_cli_accepts_tp_and_mp():
    import argparse

    from vllm import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["-tp", "2", "--distributed-executor-backend", "mp"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.tensor_parallel_size, engine_args.distributed_executor_backend) == (
        2,
        "mp",
    )


def test_ray_ranks_grouped_by_node():
    from vllm.executor.ray_utils import group_ranks_by_node

    # Bundles placed A, B, A, B: the TP pairs become (A, A) and (B, B).
    assert group_ranks_by_node(["A", "B", "A", "B"]) == [0, 2, 1, 3]
    assert group_ranks_by_node(["A", "A", "B", "B"]) == [0, 1, 2, 3]


MP_SCRIPT = """
import json, sys
import psutil
from vllm import LLM, SamplingParams

# No `if __name__ == "__main__":` guard, as in most user scripts: spawn must not re-run this.
llm = LLM(model=sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="mp",
          kv_cache_space=0.05, swap_space=0.01)
outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=8))
ids = outs[0].outputs[0].token_ids
del llm, outs
import gc
gc.collect()
# Python's own multiprocessing resource tracker (started with the first spawn) lives until
# the interpreter exits; anything else left would be a rank.
children = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(p.cmdline())]
print("RESULT " + json.dumps({"ids": ids, "children": children}))
"""


def test_mp_script_without_main_guard_cleans_up(model_dirs, reference, tmp_path):
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "user_script.py"
    script.write_text(MP_SCRIPT)
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(script), model_dirs["llama-gqa-tied"]],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=repo,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["ids"] == reference("llama-gqa-tied")[0][:8]
    assert result["children"] == []
