"""A stage that cannot be replaced: the pipeline goes on at PP - 1 and grows back to PP.

The mp backend at PP = 3 (the middle stage lost, then the first, then the last) and PP = 2
(the first stage lost: the last stage becomes the only one), and Ray at PP = 2 (the new actor
cannot be placed). Starting a stage process is made to fail in the test process (the engine
runs in it: at mp PP = 3 the new process dies at start-up, at PP = 2 it cannot be started at
all) and a stage is SIGKILLed with requests in flight. With the boundary caches (the default)
ONE neighbour takes the lost stage's layers and only their KV is replayed, on it alone: the
work is the lost stage's share of a full recompute, and every request (greedy and seeded)
finishes with the tokens of the fault-free run (greedy ones: HF's). When the neighbour cannot
hold the blocks in use with its new layers (a tiny KV space), the engine takes the even split
and recomputes in full, and says why. While starting stages still fails, growing back fails
with one log line and changes nothing; once it works again the engine grows back -- on demand
(`LLMEngine.grow_pipeline`) at PP = 3, by itself after VLLM_PP_REGROW_INTERVAL_S at PP = 2 --
with requests in flight, to the original split, and outputs match again."""

from __future__ import annotations

import signal

import pytest

from tests.utils import tiny_models
from tests.utils.faults import (
    SWAPPING_ENGINE_KW,
    after_steps,
    engine_with_reference,
    gone,
    greedy_and_seeded,
    kill_stage_pid,
    step_with_actions,
    swapping_params,
    token_ids,
)
from vllm import LLM, SamplingParams

PROMPTS = tiny_models.PROMPTS * 2
# Half greedy, half seeded random: both must come out exactly as without the fault.
PARAMS = greedy_and_seeded(len(PROMPTS))
NUM_LAYERS = 6  # tiny_models' LLaMA


def even(pp: int) -> list[tuple[int, int]]:
    """Layer ranges of an even split of the tiny model over `pp` stages."""
    sizes = [NUM_LAYERS // pp + (1 if r < NUM_LAYERS % pp else 0) for r in range(pp)]
    return [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(pp)]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("mp", 3), id="mp-pp3"),
        pytest.param(("mp", 2), id="mp-pp2"),
        pytest.param(("ray", 2), id="ray-pp2", marks=pytest.mark.ray),
    ],
)
def engine(request, tiny_model_dirs):
    """An engine and the fault-free outputs of PARAMS on it."""
    yield from engine_with_reference(request, tiny_model_dirs["llama-gqa-tied"], PROMPTS, PARAMS)


def refuse_new_stages(monkeypatch, executor, how: str) -> list[int]:
    """From now on no stage process can be started: `refused` (starting one raises; on Ray
    its actor cannot be placed in time) or `dies` (an mp process starts and is killed at
    once, before its Worker is built). Returns the ranks that were tried."""
    tried: list[int] = []
    if hasattr(executor, "workers"):  # Ray

        def start_actors(ranks, timeout=0.0) -> None:
            tried.extend(ranks)
            raise TimeoutError("the new actor could not be placed (refused by the test)")

        monkeypatch.setattr(executor, "_start_actors", start_actors)
        return tried
    spawn_for_real = executor._spawn

    def spawn(rank: int) -> None:
        tried.append(rank)
        if how == "refused":
            raise OSError("no free slot for a stage process (refused by the test)")
        spawn_for_real(rank)
        executor.procs[rank].kill()

    monkeypatch.setattr(executor, "_spawn", spawn)
    return tried


def merged(pp: int, lost: int) -> list[tuple[int, int]]:
    """Layer ranges after stage `lost` of the even split over `pp` stages left and its
    neighbour (the previous stage; for the first, the next) took its layers."""
    ranges = even(pp)
    into = lost - 1 if lost > 0 else 1
    joined = (min(ranges[lost][0], ranges[into][0]), max(ranges[lost][1], ranges[into][1]))
    return [joined if r == into else span for r, span in enumerate(ranges) if r != lost]


def assert_pipeline(llm: LLM, pp: int, layers: list[tuple[int, int]] | None = None) -> None:
    """The engine runs `pp` stages, numbered in order, with `layers` (default: the even
    split), all alive."""
    engine = llm.llm_engine
    infos = engine.get_stage_infos()
    assert engine.parallel_config.pipeline_parallel_size == pp
    assert [(i.rank, i.pp_rank) for i in infos] == [(r, r) for r in range(pp)]
    assert [i.layers for i in infos] == (layers if layers is not None else even(pp))
    assert [i.is_first for i in infos] == [r == 0 for r in range(pp)]
    assert [i.is_last for i in infos] == [r == pp - 1 for r in range(pp)]
    assert not any(gone(i.pid) for i in infos)
    assert engine.batch_queue.max_concurrent_batches >= pp
    scheduler = engine.scheduler
    assert not scheduler.in_flight and not scheduler.has_unfinished_seqs()
    manager = scheduler.block_manager
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks


def assert_local_rebuild(event, old_pp: int, logged: str) -> None:
    """The lost layers were rebuilt on the neighbour that took them: the work is the lost
    stage's share of a full recompute (every committed token through one old stage's
    layers), plus requests the rollback re-queued, through every layer."""
    extra = event.as_dict()
    assert extra["stage_recovery"] == "shrink (local)", extra
    assert extra["replayed_tokens"] > 0, extra
    in_full = extra["recomputed_tokens"] - extra["replayed_tokens"]
    share = extra["full_path_token_stages"] // old_pp
    assert extra["recomputed_token_stages"] == share + in_full * (old_pp - 1), extra
    assert extra["recomputed_token_stages"] < extra["full_path_token_stages"], extra
    assert "merged into stage" in logged and "replayed through those layers only" in logged
    assert "Shrinking the pipeline: every request is recomputed in full" not in logged


def greedy_match_hf(outputs: list[list[int]], expected: list[list[int]]) -> None:
    """The greedy requests of PARAMS (every other one) produced HF's greedy tokens."""
    for i in range(0, len(PROMPTS), 2):
        assert outputs[i] == expected[i % len(tiny_models.PROMPTS)], i


def test_unreplaceable_stage_shrinks_the_pipeline_and_it_grows_back(engine, monkeypatch, caplog):
    llm, reference = engine
    eng = llm.llm_engine
    pp = eng.parallel_config.pipeline_parallel_size
    victim = 1 if pp == 3 else 0  # a middle stage; at PP = 2 the first one
    automatic = pp == 2
    # PP = 2 grows back by itself; PP = 3 waits long enough that only grow_pipeline does.
    monkeypatch.setenv("VLLM_PP_REGROW_INTERVAL_S", "0.5" if automatic else "3600")
    # PP = 3: the new process dies at start-up; PP = 2: it cannot be started at all.
    tried = refuse_new_stages(monkeypatch, eng.executor, "refused" if automatic else "dies")
    survivors = [i.pid for i in eng.get_stage_infos() if i.rank != victim]
    killed: list[int] = []
    thread = after_steps(llm, 5, lambda: killed.append(kill_stage_pid(llm, victim, signal.SIGKILL)))
    with caplog.at_level("INFO", logger="vllm"):
        outputs = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    thread.join(timeout=60)
    assert killed and gone(killed[0]), "the stage was never killed"
    assert outputs == reference
    assert tried and tried[0] == victim
    # PP - 1 stages: the survivors' own processes, renumbered in order, the layers split evenly.
    assert_pipeline(llm, pp - 1, merged(pp, victim))
    assert [i.pid for i in eng.get_stage_infos()] == survivors
    event = eng.fault_events[-1]
    assert event.ranks == [victim]
    logged = caplog.text
    assert_local_rebuild(event, pp, logged)
    assert event.pipeline_parallel_size == pp - 1
    assert (
        f"Pipeline shrunk from PP={pp} to PP={pp - 1} after stage {victim} could not be "
        "replaced" in logged
    )
    assert eng.resilience.resizes.events[-1].reason == "shrink"
    health = eng.health()
    assert health.degraded and f"pipeline_parallel_size={pp - 1} of {pp}" in health.message
    assert eng.parallel_config.boundary_cache_enabled == (pp - 1 > 1)
    if pp - 1 == 1:
        assert not eng.batch_queue.async_pipeline and not eng.scheduler.schedule_ahead

    # Starting a stage still fails: growing back fails, says so once, and changes nothing.
    caplog.clear()
    with caplog.at_level("INFO", logger="vllm"):
        assert eng.grow_pipeline() is False
    assert caplog.text.count(f"Growing the pipeline back to PP={pp} failed") == 1
    assert_pipeline(llm, pp - 1, merged(pp, victim))
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference

    # Stages can be started again: back to PP with the original split, requests in flight.
    monkeypatch.undo()
    monkeypatch.setenv("VLLM_PP_REGROW_INTERVAL_S", "0.5" if automatic else "3600")
    caplog.clear()
    grown: list[bool] = []
    with caplog.at_level("INFO", logger="vllm"):
        if automatic:
            eng.resilience.resizes._next_grow_at = 0.0  # the failed try above pushed it back
            outputs = step_with_actions(llm, PROMPTS, PARAMS, {})
        else:
            outputs = step_with_actions(
                llm, PROMPTS, PARAMS, {3: lambda: grown.append(eng.grow_pipeline())}
            )
    assert outputs == reference
    assert automatic or grown == [True]
    assert f"Pipeline grown back from PP={pp - 1} to PP={pp}" in caplog.text
    assert_pipeline(llm, pp)
    assert [i.pid for i in eng.get_stage_infos()][: pp - 1] == survivors
    assert eng.resilience.resizes.events[-1].reason == "grow"
    assert eng.resilience.resizes.missing_stages == 0
    assert not eng.health().degraded
    assert eng.grow_pipeline() is False  # nothing missing
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference


@pytest.mark.parametrize("lost", ["first", "last"])
def test_first_or_last_stage_lost_rebuilds_only_its_layers(
    engine, lost, monkeypatch, caplog, hf_reference
):
    """mp PP = 3 -> 2 with the first stage lost (the second takes its layers and the
    embedding, replaying them from the token ids) and with the last one lost (the middle
    one takes them and the lm_head, replaying them from its own boundary rows); then back
    to PP = 3."""
    llm, reference = engine
    eng = llm.llm_engine
    pp = eng.parallel_config.pipeline_parallel_size
    if (eng.parallel_config.distributed_executor_backend, pp) != ("mp", 3):
        pytest.skip("mp PP = 3 only")
    victim = 0 if lost == "first" else pp - 1
    monkeypatch.setenv("VLLM_PP_REGROW_INTERVAL_S", "3600")
    refuse_new_stages(monkeypatch, eng.executor, "dies")
    thread = after_steps(llm, 5, lambda: kill_stage_pid(llm, victim, signal.SIGKILL))
    with caplog.at_level("INFO", logger="vllm"):
        outputs = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    thread.join(timeout=60)
    assert outputs == reference
    greedy_match_hf(outputs, hf_reference("llama-gqa-tied"))
    assert_pipeline(llm, pp - 1, merged(pp, victim))
    assert_local_rebuild(eng.fault_events[-1], pp, caplog.text)
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference
    monkeypatch.undo()
    assert eng.grow_pipeline() is True
    assert_pipeline(llm, pp)
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference


def test_swapped_and_parallel_sampled_groups_come_back_with_the_local_rebuild(
    tiny_model_dirs, monkeypatch, caplog
):
    """mp PP = 3 -> 2, the middle stage lost, with chunked prefill, prefix caching, a small
    cache that swaps and n = 2 seeded sampling: swapped groups are swapped in before the
    merged stage's host tensors are re-made (the swap space shrinks to what it holds with
    its new layers), and outputs equal the fault-free run."""
    # One chunk of a prompt at a time: the kill below waits until a swapped group has room to
    # come back with the replay, and chunks scheduled behind others in the steps before the
    # failure is found could take that room (the group is then recomputed in full, correctly,
    # but this test is about the swap-in). Chunks in flight at a failure:
    # tests/distributed/test_chunked_pipelining.py.
    monkeypatch.setenv("VLLM_PP_CHUNKED_PIPELINING", "0")
    params = swapping_params(len(PROMPTS))
    llm = LLM(
        tiny_model_dirs["llama-gqa-untied"],
        pipeline_parallel_size=3,
        distributed_executor_backend="mp",
        **SWAPPING_ENGINE_KW,
    )

    def samples(outputs) -> list[list[list[int]]]:
        return [[list(c.token_ids) for c in o.outputs] for o in outputs]

    try:
        eng = llm.llm_engine
        reference = samples(llm.generate(PROMPTS, params, use_tqdm=False))
        host_blocks = eng.cache_config.num_cpu_blocks
        monkeypatch.setenv("VLLM_PP_REGROW_INTERVAL_S", "3600")
        refuse_new_stages(monkeypatch, eng.executor, "dies")
        for i, prompt in enumerate(PROMPTS):
            eng.add_request(str(i), prompt, params[i])
        finished: dict[str, list[list[int]]] = {}
        killed = False
        swapped_for = 0  # steps in a row with a group swapped out
        with caplog.at_level("INFO", logger="vllm"):
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        finished[out.request_id] = [list(c.token_ids) for c in out.outputs]
                swapped_for = swapped_for + 1 if eng.scheduler.swapped else 0
                free = eng.scheduler.block_manager.get_num_free_gpu_blocks()
                if not killed and swapped_for > 3 and free >= 12:
                    # Swapped out a few steps ago: still swapped when the failure is found,
                    # with room to come back with the replay.
                    kill_stage_pid(llm, 1, signal.SIGKILL)
                    killed = True
        assert killed, "no group was ever swapped out"
        outputs = [finished[str(i)] for i in range(len(PROMPTS))]
        assert outputs == reference
        assert_pipeline(llm, 2, merged(3, 1))
        event = eng.fault_events[-1]
        assert_local_rebuild(event, 3, caplog.text)
        assert event.swapped_in_requests > 0, event.as_dict()
        # The merged stage holds fewer host blocks with 4 layers: the pool follows it.
        assert eng.cache_config.num_gpu_blocks == 64
        assert eng.cache_config.num_cpu_blocks < host_blocks
        bm = eng.scheduler.block_manager
        assert bm.num_total_cpu_blocks == eng.cache_config.num_cpu_blocks
        assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
        assert samples(llm.generate(PROMPTS, params, use_tqdm=False)) == reference
    finally:
        llm.shutdown()


def test_a_neighbour_that_cannot_hold_the_blocks_in_use_takes_the_full_path(
    tiny_model_dirs, monkeypatch, caplog
):
    """mp PP = 3 with a tiny KV space (40 blocks of 16 tokens per 2-layer stage, boundary
    rows included): with the lost middle stage's layers its neighbour would hold 24, fewer
    than the 16 requests use 15 steps in. The engine takes the even split and recomputes
    every request, says why, and outputs equal the fault-free run."""
    # Bytes of one block of a non-last 2-layer stage of the tiny LLaMA (fp32): K and V of
    # 2 KV heads x 16 per token per layer, plus a 64-wide boundary row per token.
    block_bytes = 16 * (2 * 2 * 2 * 16 + 64) * 4
    llm = LLM(
        tiny_model_dirs["llama-gqa-tied"],
        pipeline_parallel_size=3,
        distributed_executor_backend="mp",
        kv_cache_space=40 * block_bytes / 2**30,
        max_model_len=128,
        disable_log_stats=True,
    )
    try:
        eng = llm.llm_engine
        assert eng.cache_config.num_gpu_blocks == 40
        reference = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        monkeypatch.setenv("VLLM_PP_REGROW_INTERVAL_S", "3600")
        refuse_new_stages(monkeypatch, eng.executor, "dies")
        thread = after_steps(llm, 15, lambda: kill_stage_pid(llm, 1, signal.SIGKILL))
        with caplog.at_level("INFO", logger="vllm"):
            outputs = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        thread.join(timeout=60)
        assert outputs == reference
        assert_pipeline(llm, 2)  # the even split
        extra = eng.fault_events[-1].as_dict()
        assert extra["stage_recovery"] == "shrink", extra
        assert extra["recomputed_token_stages"] == extra["full_path_token_stages"] * 2 // 3
        assert (
            "Shrinking the pipeline: every request is recomputed in full (with its new "
            "layers stage 0 holds 24 device" in caplog.text
        )
    finally:
        llm.shutdown()


def test_a_tp_stage_leaves_with_all_its_ranks_and_comes_back(tiny_model_dirs, hf_reference):
    """TP = 2 x PP = 2 (mp): one TP rank of the last stage is killed and cannot be replaced;
    both ranks of that stage leave (PP = 1, TP = 2), then come back on grow_pipeline. Greedy
    outputs equal HF's throughout."""
    kind = "llama-gqa-tied"
    llm = LLM(
        tiny_model_dirs[kind],
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        disable_log_stats=True,
    )
    try:
        eng = llm.llm_engine
        greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        expected = hf_reference(kind)
        with pytest.MonkeyPatch.context() as monkeypatch:
            refuse_new_stages(monkeypatch, eng.executor, "refused")
            thread = after_steps(llm, 4, lambda: kill_stage_pid(llm, 3, signal.SIGKILL))
            outputs = llm.generate(tiny_models.PROMPTS, greedy, use_tqdm=False)
            thread.join(timeout=60)
            assert token_ids(outputs) == expected
            infos = eng.get_stage_infos()
            assert [(i.rank, i.pp_rank, i.tp_rank) for i in infos] == [(0, 0, 0), (1, 0, 1)]
            assert [i.layers for i in infos] == [(0, NUM_LAYERS)] * 2
            # Each TP rank of stage 0 replayed its shard of the last stage's layers.
            assert eng.fault_events[-1].stage_recovery == "shrink (local)"
        assert eng.grow_pipeline() is True
        infos = eng.get_stage_infos()
        assert [(i.rank, i.pp_rank, i.tp_rank) for i in infos] == [
            (0, 0, 0),
            (1, 0, 1),
            (2, 1, 0),
            (3, 1, 1),
        ]
        assert [i.layers for i in infos] == [(0, 3), (0, 3), (3, 6), (3, 6)]
        outputs = llm.generate(tiny_models.PROMPTS, greedy, use_tqdm=False)
        assert token_ids(outputs) == expected
        tokenizer = llm.get_tokenizer()
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
        assert [o.outputs[0].text for o in outputs] == texts
    finally:
        llm.shutdown()


def test_a_replacement_that_dies_in_the_rendezvous_still_leaves_a_pipeline(
    tiny_model_dirs, monkeypatch
):
    """mp PP = 2: the replacement of a killed stage dies inside the group rendezvous, where
    the survivor waits for it until the groups' timeout (5 s + 0.05 s x 128 tokens = 11.4 s,
    longer than the 8 s restart deadline set here). The survivor sits that out, the pipeline
    goes on at PP = 1, and every request finishes with the fault-free tokens."""
    monkeypatch.setenv("VLLM_PP_STAGE_RESTART_TIMEOUT_S", "8")
    llm = LLM(
        tiny_model_dirs["llama-gqa-tied"],
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        step_timeout_s=5,
        max_model_len=128,
        max_num_batched_tokens=128,
        max_num_seqs=16,
        disable_log_stats=True,
    )
    try:
        engine = llm.llm_engine
        reference = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        executor = engine.executor
        submit = executor._submit

        def submit_then_kill_the_joiner(calls):
            call_id = submit(calls)
            for rank, (method, _, _) in calls.items():
                if method == "init_device":  # a new rank's rendezvous: it dies there
                    executor.procs[rank].kill()
            return call_id

        monkeypatch.setattr(executor, "_submit", submit_then_kill_the_joiner)
        thread = after_steps(llm, 4, lambda: kill_stage_pid(llm, 1, signal.SIGKILL))
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        thread.join(timeout=60)
        assert token_ids(outputs) == reference
        assert engine.parallel_config.pipeline_parallel_size == 1
        assert engine.fault_events[-1].stage_recovery == "shrink (local)"
    finally:
        llm.shutdown()
