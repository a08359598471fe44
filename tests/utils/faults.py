"""Faults injected into a running engine: kill or freeze a stage, after some steps."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from vllm import LLM, SamplingParams


def kill_stage(llm: LLM, rank: int, mode: str) -> int:
    """Kill (or freeze) one stage of a running engine; returns its pid."""
    import ray

    executor = llm.llm_engine.executor
    pid = llm.llm_engine.get_stage_infos()[rank].pid
    if mode == "ray.kill":
        ray.kill(executor.workers[rank])
    elif mode == "SIGKILL":
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGSTOP)
    return pid


def kill_stage_pid(llm: LLM, rank: int, sig: int) -> int:
    """Signal one stage's process (any backend); returns its pid."""
    pid = llm.llm_engine.get_stage_infos()[rank].pid
    os.kill(pid, sig)
    return pid


def after_steps(llm: LLM, steps: int, action) -> threading.Thread:
    """Run `action()` from another thread once the engine has made `steps` more steps."""
    engine = llm.llm_engine
    start = engine.num_steps

    def run() -> None:
        deadline = time.monotonic() + 120
        while engine.num_steps < start + steps:
            if time.monotonic() > deadline:
                return  # never reached: the test's own assertions report it
            time.sleep(0.0005)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def kill_before_a_step(
    llm: LLM, rank: int, when: Callable[[Any], bool], pause_s: float = 0.0
) -> Iterator[list[int]]:
    """While inside: the first step whose SchedulerOutputs `when` accepts is submitted only
    after `rank` was SIGKILLed and `pause_s` passed (long enough, and the engine knows the
    rank is gone, so the submission fails). Yields the killed pid, once there is one."""
    queue = llm.llm_engine.batch_queue
    submit = queue.submit
    fired: list[int] = []

    def submit_after_a_kill(scheduler_outputs: Any, *args: Any, **kwargs: Any) -> None:
        if not fired and when(scheduler_outputs):
            fired.append(kill_stage_pid(llm, rank, signal.SIGKILL))
            time.sleep(pause_s)
        submit(scheduler_outputs, *args, **kwargs)

    queue.submit = submit_after_a_kill  # type: ignore[method-assign]
    try:
        yield fired
    finally:
        del queue.submit


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def token_ids(outputs) -> list[list[int]]:
    """Each request's token ids, in order."""
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy_and_seeded(count: int) -> list[SamplingParams]:
    """Half greedy, half seeded random (32 tokens, no EOS): both must come out exactly as in
    a run without the fault or the change of shape."""
    return [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True)
        for i in range(count)
    ]


def engine_with_reference(
    request, model: str, prompts: list[str], params: list[SamplingParams]
) -> Iterator[tuple[LLM, list[list[int]]]]:
    """A module fixture's body: an engine on `request.param` = (backend, pp) and its
    fault-free token ids of `prompts` (Ray's session started when it is Ray)."""
    backend, pp = request.param
    if backend == "ray":
        request.getfixturevalue("ray_session")
    llm = LLM(
        model,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        disable_log_stats=True,
    )
    reference = token_ids(llm.generate(prompts, params, use_tqdm=False))
    yield llm, reference
    llm.shutdown()


def step_with_actions(
    llm: LLM, prompts: list[str], params: list, actions: dict[int, Callable[[], object]]
) -> list[list[int]]:
    """Run `prompts` with `params` step by step, calling `actions[n]()` after step n while a
    batch is still in flight (a kill, a re-split, a grow); each request's token ids."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params[i])
    outputs: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        if step in actions:
            assert len(engine.batch_queue) > 0, f"no batch in flight after step {step}"
            actions[step]()
    return [outputs[str(i)] for i in range(len(prompts))]


def swapping_params(count: int) -> list[SamplingParams]:
    """A third greedy, a third seeded, a third seeded with n = 2 (40 tokens, no EOS): parallel
    samples that a small cache swaps out."""
    return [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(temperature=1.0, seed=i, max_tokens=40, n=2 if i % 3 == 2 else 1)
        for i in range(count)
    ]


# Small blocks and cache: with `swapping_params` n = 2 groups are swapped out (preempted)
# around a fault; chunked prefill and prefix caching on.
SWAPPING_ENGINE_KW = dict(
    enable_chunked_prefill=True,
    # Large enough for samples that diverged before a full recompute (never chunked: a group
    # of several sequences over the budget is ignored, a limit of the full path).
    max_num_batched_tokens=256,
    max_num_seqs=16,
    enable_prefix_caching=True,
    block_size=4,
    num_gpu_blocks_override=64,
    swap_space=0.01,
    max_model_len=128,
    disable_log_stats=True,
)
