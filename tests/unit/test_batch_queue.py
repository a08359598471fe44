"""The batch queue, the step records and scheduling ahead, with a fake pipeline (torch-free).

The fake pipeline applies each step message to a `RequestTable` exactly as the first and
last stages do, and "samples" a token that is a fixed function of the sequence's tokens as the
stage holds them. A stale or missing token anywhere (a wrong delta, a decode scheduled ahead
that fed the wrong token) changes every later token, so the final outputs are compared with
a plain sequential generation of the same function.
"""

from __future__ import annotations

import pytest

from tests.utils.fake_requests import FakeParams
from tests.utils.fake_requests import seq_ids as _seq_ids
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.budget import MicroBatchBudget
from vllm.core.scheduler import Scheduler
from vllm.engine.batch_queue import BatchQueue
from vllm.executor.step_future import StepFuture
from vllm.sequence import (
    Logprob,
    Sequence,
    SequenceGroup,
    SequenceGroupOutput,
    SequenceOutput,
    SequenceStatus,
)
from vllm.step_records import CachedSeqData, ExecuteModelRequest
from vllm.worker.request_table import RequestTable

pytestmark = pytest.mark.fast

STOP = 5


def next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 3) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97 + 3


def sequential(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        if token == STOP:
            break
    return out


class FakePipeline:
    """Runs submitted steps in order, lazily, like stages that run their calls in order."""

    def __init__(self, pp: int, fail_step: int = -1) -> None:
        self.pp = pp
        self.state = RequestTable()
        self.submitted: list[ExecuteModelRequest] = []
        self.outputs: dict[int, list[SequenceGroupOutput]] = {}
        self.fail_step = fail_step
        self.max_wait_gap = None  # smallest (step - the step whose sampled ids it waits on)

    def execute_model(
        self, request: ExecuteModelRequest, non_block: bool = True, num_tokens: int = 0
    ) -> StepFuture:
        assert non_block
        self.submitted.append(request)
        index = len(self.submitted) - 1
        return StepFuture(index, lambda: self.get_output(index))

    def _run(self, index: int) -> None:
        request = self.submitted[index]
        step = request.step
        assert step is not None
        pending = [
            s for g in step.groups for s in g.seqs if isinstance(s, CachedSeqData) and s.num_pending
        ]
        if pending:
            # The first stage would wait for these ids: they must come from an older step.
            gap = step.step_no - step.recv_sampled_through
            assert gap >= 1
            self.max_wait_gap = gap if self.max_wait_gap is None else min(self.max_wait_gap, gap)
        self.state.drop(request.finished_request_ids)
        metadata = self.state.apply(step).groups
        outputs, pairs = [], []
        for meta in metadata:
            samples = []
            if meta.do_sample:
                for seq_id, data in meta.seq_data.items():
                    token = next_token(data.get_token_ids())
                    samples.append(SequenceOutput(seq_id, token, {token: Logprob(0.0)}))
                    pairs.append((seq_id, token))
            outputs.append(SequenceGroupOutput(samples))
        self.state.record_sampled(pairs)
        self.outputs[index] = outputs

    def get_output(self, handle: int) -> list[SequenceGroupOutput]:
        if handle == self.fail_step:
            self.fail_step = -1
            raise RuntimeError("stage 1 raised")
        for index in range(len(self.outputs), handle + 1):
            if index not in self.outputs:
                self._run(index)
        return self.outputs[handle]

    def discard_steps(self) -> None:
        pass


class MiniEngine:
    """The engine's loop without torch: schedule, submit, collect, append, stop, free."""

    def __init__(self, pp: int, lookahead: bool, gpu_blocks: int = 64, fail_step: int = -1):
        cache = CacheConfig(block_size=4, num_gpu_blocks=gpu_blocks, num_cpu_blocks=0)
        config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32, max_model_len=256)
        self.pp = pp
        budget = MicroBatchBudget.from_config(config, cohorts=pp)
        self.scheduler = Scheduler(config, cache, budget, schedule_ahead=lookahead)
        self.pipeline = FakePipeline(pp, fail_step)
        self.queue = BatchQueue(self.pipeline, pp, lookahead)
        self.finished_ids: list[str] = []
        self.groups: dict[str, SequenceGroup] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        seq = Sequence(next(_seq_ids), "p", prompt, block_size=4)
        params = FakeParams(max_tokens=max_tokens)
        group = SequenceGroup(request_id, [seq], params, arrival_time=float(len(self.groups)))
        self.groups[request_id] = group
        self.scheduler.add_seq_group(group)

    def step(self) -> None:
        sched = self.scheduler
        while not self.queue.is_full():
            records, out = sched.schedule(self.queue.next_step_no)
            if out.is_empty():
                break
            finished, self.finished_ids = self.finished_ids, []
            self.queue.submit(out, records, finished, 0)
            sched.commit_step(out)  # as the engine: once the executor accepted the step
        if not len(self.queue):
            return
        out, output = self.queue.collect_oldest()
        groups = out.scheduled_seq_groups
        sched.finish_in_flight([g.request_id for g in groups])
        for group, group_output in zip(groups, output):
            if group.is_finished() or group.is_prefill():
                continue
            by_parent = {s.parent_seq_id: s for s in group_output.samples}
            for seq in group.get_seqs(status=SequenceStatus.RUNNING):
                sample = by_parent[seq.seq_id]
                seq.append_token_id(sample.output_token, sample.logprobs)
                if sample.output_token == STOP or seq.get_output_len() >= (
                    group.sampling_params.max_tokens
                ):
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    sched.free_seq(seq)
            if group.is_finished():
                self.finished_ids.append(group.request_id)
        sched.free_finished_seq_groups()

    def run(self) -> None:
        for _ in range(10_000):
            if not (self.scheduler.has_unfinished_seqs() or len(self.queue)):
                return
            self.step()
        raise AssertionError("the engine did not finish")


def _prompts(count: int) -> list[list[int]]:
    return [[(7 * i + j) % 50 + 1 for j in range(3 + i % 9)] for i in range(count)]


@pytest.mark.parametrize("pp,lookahead", [(1, False), (2, False), (2, True), (3, True)])
def test_outputs_equal_sequential_generation(pp, lookahead):
    engine = MiniEngine(pp, lookahead)
    prompts = _prompts(12)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, max_tokens=10 + i)
    engine.run()
    for i, prompt in enumerate(prompts):
        seq = engine.groups[f"r{i}"].get_seqs()[0]
        assert seq.get_output_token_ids() == sequential(prompt, 10 + i), f"r{i}"
    block_manager = engine.scheduler.block_manager
    assert block_manager.get_num_free_gpu_blocks() == block_manager.num_total_gpu_blocks
    assert not engine.scheduler.in_flight
    stats = engine.queue.stats
    if lookahead:
        assert stats.ahead_groups > 0
        # Round robin: an ahead step waits on a step at least pp steps older.
        assert engine.pipeline.max_wait_gap >= pp
    else:
        assert stats.ahead_groups == 0


def test_queue_depth_and_order():
    engine = MiniEngine(2, lookahead=True)
    for i, prompt in enumerate(_prompts(8)):
        engine.add(f"r{i}", prompt, max_tokens=40)
    for _ in range(6):
        engine.step()
    assert len(engine.queue) <= engine.queue.max_concurrent_batches == 4
    # After the prompts, micro-batches alternate between the two cohorts.
    cohorts = [
        frozenset(g.request_id for g in s.step.groups) for s in engine.pipeline.submitted[2:8]
    ]
    assert cohorts[0] != cohorts[1] and cohorts[0::2] == [cohorts[0]] * len(cohorts[0::2])


def test_abort_while_two_steps_in_flight_frees_after_return():
    engine = MiniEngine(2, lookahead=True)
    prompts = _prompts(6)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, max_tokens=30)
    sched = engine.scheduler
    for _ in range(8):
        engine.step()
    deep = [rid for rid, group in sched.in_flight.items() if len(group.flights) == 2]
    assert deep, "some groups have two steps in flight"
    victim = deep[0]
    blocks_before = sched.block_manager.get_num_free_gpu_blocks()
    sched.abort_seq_group(victim)
    engine.finished_ids.append(victim)
    # Its blocks stay allocated while its steps are inside the pipeline.
    assert sched.block_manager.get_num_free_gpu_blocks() == blocks_before
    engine.run()
    for i, prompt in enumerate(prompts):
        if f"r{i}" == victim:
            continue
        seq = engine.groups[f"r{i}"].get_seqs()[0]
        assert seq.get_output_token_ids() == sequential(prompt, 30)
    assert sched.block_manager.get_num_free_gpu_blocks() == sched.block_manager.num_total_gpu_blocks


def test_preemption_never_touches_in_flight_groups():
    engine = MiniEngine(2, lookahead=True, gpu_blocks=14)
    sched = engine.scheduler
    preempted = []
    original = sched._preempt

    def checked(seq_group, out):
        assert seq_group.request_id not in sched.in_flight, "preempted an in-flight group"
        preempted.append(seq_group.request_id)
        original(seq_group, out)

    sched._preempt = checked
    prompts = _prompts(8)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, max_tokens=24)
    engine.run()
    assert preempted, "the small cache forces preemption"
    for i, prompt in enumerate(prompts):
        assert engine.groups[f"r{i}"].get_seqs()[0].get_output_token_ids() == sequential(prompt, 24)


def test_error_keeps_batch_then_discard_resets_stages():
    engine = MiniEngine(2, lookahead=True, fail_step=5)
    for i, prompt in enumerate(_prompts(6)):
        engine.add(f"r{i}", prompt, max_tokens=20)
    with pytest.raises(RuntimeError, match="stage 1 raised"):
        for _ in range(20):
            engine.step()
    in_queue = len(engine.queue)
    assert in_queue > 0  # the failed batch was not dropped silently
    engine.queue.discard()
    assert len(engine.queue) == 0
    engine.scheduler.requeue_in_flight()
    engine.step()
    first_after = engine.pipeline.submitted[-in_queue - 0 :]
    assert any(r.step.reset for r in first_after)
    engine.run()
    for i, prompt in enumerate(_prompts(6)):
        assert engine.groups[f"r{i}"].get_seqs()[0].get_output_token_ids() == sequential(prompt, 20)
