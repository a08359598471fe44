"""AsyncLLMEngine: many concurrent generate() coroutines with random cancellations (PP = 1
and 2), engine errors failing every waiter, bad requests refused alone, vLLM's API surface
(Ray Data's calls)."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.utils import tiny_models
from vllm import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from vllm.engine.async_llm_engine import AsyncEngineDeadError
from vllm.sampling_params import RequestOutputKind

KIND = "llama-gqa-tied"
SETTINGS = dict(kv_cache_space=0.05, swap_space=0.01, disable_log_requests=True)
GREEDY = SamplingParams(temperature=0, max_tokens=24)
WAIT = 120.0  # every await in these tests is bounded


def make_engine(path: str, **kwargs) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=path, **SETTINGS, **kwargs))


def assert_no_leaks(engine: AsyncLLMEngine) -> None:
    scheduler = engine.engine.scheduler
    bm = scheduler.block_manager
    assert not scheduler.has_unfinished_seqs() and not scheduler.in_flight
    assert not engine.engine.has_unfinished_requests()
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert not engine._streams and not engine._active


async def settle(engine: AsyncLLMEngine) -> None:
    """Let the engine thread apply the last aborts (bounded)."""
    for _ in range(400):
        if not engine.engine.has_unfinished_requests() and not engine._active:
            return
        await asyncio.sleep(0.01)


async def final(engine: AsyncLLMEngine, prompt, params, request_id):
    last = None
    async for out in engine.generate(prompt, params, request_id):
        last = out
    return last


@pytest.fixture(scope="module")
def expected(tiny_model_dirs):
    llm = LLM(tiny_model_dirs[KIND], kv_cache_space=0.05, swap_space=0.01)
    outs = llm.generate(tiny_models.PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("pp", [1, 2])
def test_concurrent_requests_with_random_cancellations(pp, request, tiny_model_dirs, expected):
    if pp > 1:
        request.getfixturevalue("ray_session")
    engine = make_engine(tiny_model_dirs[KIND], pipeline_parallel_size=pp, max_num_seqs=16)
    rng = random.Random(pp)
    n = 60
    prompts = tiny_models.PROMPTS

    started: set[int] = set()

    async def one(i: int):
        await asyncio.sleep(rng.random() * 0.3)  # staggered arrivals
        last = None
        async for out in engine.generate(prompts[i % len(prompts)], GREEDY, f"req-{i}"):
            started.add(i)
            last = out
        return last

    async def main():
        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        mid = set(rng.sample(range(n), n // 4))  # cancelled once they are generating
        early = set(rng.sample(sorted(set(range(n)) - mid), n // 10))  # before they start
        for i in early:
            tasks[i].cancel()
        pending = set(mid)
        while pending:
            for i in sorted(pending):
                if i in started or tasks[i].done():
                    await asyncio.sleep(rng.random() * 0.005)
                    tasks[i].cancel()
                    pending.discard(i)
            await asyncio.sleep(0.001)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)
        await settle(engine)
        return mid | early, results

    try:
        cancelled, results = asyncio.run(main())
        done = 0
        for i, result in enumerate(results):
            if isinstance(result, asyncio.CancelledError):
                assert i in cancelled
                continue
            assert not isinstance(result, BaseException), result
            assert result.finished
            assert result.outputs[0].token_ids == expected[i % len(prompts)], i
            done += 1
        assert done >= n - len(cancelled)
        # Requests were cancelled mid-generation, not only before they started.
        cut = {i for i, r in enumerate(results) if isinstance(r, asyncio.CancelledError)}
        assert len(cut & started) >= 3, (cut, started)
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    eng = make_engine(tiny_model_dirs[KIND])
    yield eng
    eng.shutdown()


def test_streaming_outputs_and_kinds(engine, expected):
    async def main():
        cumulative = [o async for o in engine.generate(tiny_models.PROMPTS[1], GREEDY, "c")]
        delta_params = GREEDY.clone()
        delta_params.output_kind = RequestOutputKind.DELTA
        deltas = [o async for o in engine.generate(tiny_models.PROMPTS[1], delta_params, "d")]
        return cumulative, deltas

    cumulative, deltas = asyncio.run(main())
    assert len(cumulative) == 24 and cumulative[-1].finished
    assert not any(o.finished for o in cumulative[:-1])
    assert cumulative[-1].outputs[0].token_ids == expected[1]
    assert [t for o in deltas for t in o.outputs[0].token_ids] == expected[1]
    assert "".join(o.outputs[0].text for o in deltas) == cumulative[-1].outputs[0].text


def test_bad_request_is_refused_alone(engine, expected):
    async def main():
        good = asyncio.create_task(final(engine, tiny_models.PROMPTS[0], GREEDY, "good"))
        with pytest.raises(ValueError, match="out of vocabulary"):
            await final(engine, {"prompt_token_ids": [1, 10**9]}, GREEDY, "bad")
        with pytest.raises(TypeError):
            await final(engine, 3.5, GREEDY, "bad2")
        with pytest.raises(ValueError, match="best_of"):
            await final(engine, "x", SamplingParams(n=2, best_of=1000, temperature=1), "bad3")
        return await asyncio.wait_for(good, WAIT)

    out = asyncio.run(main())
    assert out.outputs[0].token_ids == expected[0]
    assert_no_leaks(engine)


def test_abort_and_duplicate_ids(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        gen = engine.generate("Hello", params, "long")
        first = await gen.__anext__()
        with pytest.raises(ValueError, match="already exists"):
            await engine.generate("Hello", params, "long").__anext__()
        await engine.abort("long")
        rest = []
        with pytest.raises(asyncio.CancelledError):  # vLLM's contract for an aborted stream
            async for o in gen:
                rest.append(o)
        await settle(engine)
        return first, rest

    first, rest = asyncio.run(main())
    assert len(first.outputs[0].token_ids) == 1
    assert len(rest) < 399
    assert_no_leaks(engine)


def test_abort_raises_cancelled_error_in_the_consumer(engine):
    """vLLM's test_cancellation: aborting a request while a task consumes its stream raises
    CancelledError in that task (after the outputs already queued for it: the engine thread
    may have run ahead of a slow consumer), never a finished output."""
    # Far more tokens than the consumer waits for: on a loaded machine the engine thread may
    # run well ahead of the consumer, and must not finish the request before the abort.
    params = SamplingParams(temperature=0, min_tokens=400, max_tokens=400)

    async def main():
        seen = 0
        with pytest.raises(asyncio.CancelledError):
            async for out in engine.generate("test2", params, "cancel-me"):
                assert not out.finished
                seen += 1
                if seen == 5:
                    await engine.abort("cancel-me")
        await settle(engine)
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), WAIT))
    assert 5 <= seen < 400
    assert_no_leaks(engine)


def test_ray_data_style_calls(engine, tiny_model_dirs):
    args = AsyncEngineArgs(model=tiny_model_dirs[KIND], **SETTINGS)
    config = args.create_engine_config()
    assert config.scheduler_config.max_num_seqs == 256
    # Serving's default: chunked prefill (a burst's first tokens do not wait for its last
    # prompt), as vLLM V1.
    assert config.scheduler_config.chunked_prefill_enabled
    assert config.parallel_config.pipeline_parallel_size == 1

    async def main():
        await engine.check_health()
        model_config = await engine.get_model_config()
        stream = engine.generate(
            request_id="rd-1",
            prompt={"prompt_token_ids": [5, 6, 7]},
            sampling_params=SamplingParams(temperature=0, max_tokens=3),
            lora_request=None,
        )
        outs = [o async for o in stream]
        return model_config, outs

    model_config, outs = asyncio.run(main())
    assert model_config.max_model_len == 512
    assert outs[-1].finished and outs[-1].prompt_token_ids == [5, 6, 7]


def test_engine_error_fails_every_waiter(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs[KIND])
    real_step = engine.engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("stage 1 exploded")
        return real_step()

    engine.engine.step = failing_step
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        tasks = [
            asyncio.create_task(final(engine, tiny_models.PROMPTS[i], params, str(i)))
            for i in range(6)
        ]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)
        with pytest.raises(AsyncEngineDeadError):
            await engine.check_health()
        with pytest.raises(AsyncEngineDeadError):
            await final(engine, "late", params, "late")
        return results

    try:
        results = asyncio.run(main())
        assert all(isinstance(r, AsyncEngineDeadError) for r in results), results
        assert "stage 1 exploded" in str(results[0])
        assert isinstance(results[0].__cause__, RuntimeError)
        assert engine.errored and not engine.is_running
    finally:
        engine.engine.step = real_step
        engine.shutdown()
