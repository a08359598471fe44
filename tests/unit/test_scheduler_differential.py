"""Differential test: the live scheduler decides exactly as the frozen reference copy
(`tests/unit/reference_scheduler`, the scheduler before it was recomposed), on random workloads.

Each seed draws a workload (either policy, PP 1-3 with its micro-batch cohorts, scheduling
ahead, prefix caching, swap or recompute preemption, parallel sampling, beam search, prompts
too long to ever run, aborts, interrupts and stage failures) and runs it through two copies of
the engine's loop, one per scheduler, in lock step: schedule until the batch queue is full,
collect the oldest batch, "sample" deterministic tokens from the sequences' own token ids, and
apply them with the engine's real `OutputProcessor` (forks, stop checks, frees). After every
`schedule()` call the two results must be equal field by field (every field of
`SchedulerOutputs`, every metadata record), and so must the queues, the in-flight groups, the
block manager's free blocks and the KV bound. Torch-free: milliseconds per workload.

The live scheduler writes records (new requests in full, then what changed), not metadata: the
live side commits each submitted step and applies its records to a stage's `RequestTable`, as
the engine and the first and last stages do, and the rows that table hands the model runner
must equal the reference's metadata. A decode scheduled ahead carries the token its step in
flight will sample (the fake sampler's, fed to the table as the last stage would); it is
stripped before comparing, as the reference's metadata does not have it yet.

Three differences are intended and mapped here, nowhere else (the third by switching it off:
chunked pipelining, several chunks of one prompt in flight, is newer than the reference):
- The reference numbers its own non-empty batches and names the batch a decode scheduled
  ahead depends on by that number (the batch queue then searched for its step); the live
  scheduler is given the batch queue's step number, so `ahead` names steps directly. The
  driver keeps the reference's batch -> step map to compare the two.
- The micro-batch cohorts: the reference divided the chunked policy's token budget by the
  pipeline size while the engine split the sequences by `VLLM_PP_MICRO_BATCHES`; the live
  scheduler uses the engine's cohorts everywhere. The reference is therefore built with
  `pipeline_parallel_size = cohorts`, the behaviour the live scheduler must keep.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.unit.reference_scheduler.scheduler import Scheduler as ReferenceScheduler
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.budget import MicroBatchBudget
from vllm.core.scheduler import Scheduler
from vllm.engine.output_processor import OutputProcessor
from vllm.sampling_params import SamplingParams
from vllm.sequence import (
    Logprob,
    Sequence,
    SequenceData,
    SequenceGroup,
    SequenceGroupOutput,
    SequenceOutput,
    SequenceStatus,
)
from vllm.step_records import CachedSeqData, StepMessage
from vllm.utils import ceil_div
from vllm.worker.request_table import RequestTable

pytestmark = pytest.mark.fast

NUM_SEEDS = 300
EOS = 2


@dataclass
class Request:
    arrives: int  # the engine step it is added before
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass
class Workload:
    """One random run: configuration, requests and the events of each engine step."""

    chunked: bool
    pp: int
    cohorts: int
    lookahead: bool
    caching: bool
    preemption_mode: str | None
    block_size: int
    gpu_blocks: int
    cpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Sampled ids are 2 (EOS) .. vocab + 1: a small vocabulary stops sequences often.
    vocab: int = 59
    requests: list[Request] = field(default_factory=list)
    # engine step -> request ids to abort / "interrupt" / "stage failure"
    events: dict[int, list[Any]] = field(default_factory=dict)


def draw_workload(seed: int) -> Workload:
    rng = random.Random(seed)
    chunked = rng.random() < 0.5
    pp = rng.choice([1, 2, 3])
    # The engine's cohorts: one per stage, or VLLM_PP_MICRO_BATCHES (ignored at PP 1).
    cohorts = pp if pp == 1 or rng.random() < 0.75 else rng.choice([1, 2, 3, 4])
    max_model_len = rng.choice([24, 48, 96])
    max_num_seqs = rng.randint(2, 12)
    if chunked:
        max_tokens = rng.randint(max(max_num_seqs, 6), 64)
    else:
        max_tokens = rng.randint(max(max_model_len, max_num_seqs), 2 * max_model_len)
    mode = rng.choice([None, "swap", "recompute"])
    w = Workload(
        chunked=chunked,
        pp=pp,
        cohorts=cohorts,
        lookahead=pp > 1 and rng.random() < 0.6,
        caching=rng.random() < 0.5,
        preemption_mode=mode,
        block_size=rng.choice([4, 8]),
        gpu_blocks=rng.randint(6, 48),
        cpu_blocks=rng.choice([0, 16, 200]) if mode != "swap" else rng.choice([16, 200]),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
        max_model_len=max_model_len,
        vocab=rng.choice([59, 59, 6]),
    )
    prefixes = [[rng.randint(3, 60) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    for i in range(rng.randint(3, 28)):
        length = rng.randint(1, max_model_len + 6)
        prompt = [rng.randint(3, 60) for _ in range(length)]
        if w.caching and rng.random() < 0.6:
            prompt = (rng.choice(prefixes) + prompt)[: max(length, 1)]
        best_of = 1 if rng.random() < 0.7 else rng.randint(2, min(3, max_num_seqs))
        n = rng.randint(1, best_of)
        max_out = rng.choice([None, rng.randint(1, 30)])
        if best_of > 1 and rng.random() < 0.3:
            params = SamplingParams(
                n=n, best_of=best_of, max_tokens=max_out, use_beam_search=True, temperature=0.0
            )
        else:
            params = SamplingParams(
                n=n, best_of=best_of, max_tokens=max_out, ignore_eos=rng.random() < 0.3
            )
        arrives = rng.randint(0, 30)
        # Equal arrival times happen (FCFS ties keep queue order).
        arrival = float(arrives) + rng.choice([0.0, 0.0, 0.5])
        w.requests.append(Request(arrives, f"r{i}", prompt, params, arrival))
    ids = [r.request_id for r in w.requests] + ["unknown"]
    for step in range(120):
        roll = rng.random()
        events = w.events.setdefault(step, [])
        if roll < 0.05:
            events.append(("abort", rng.sample(ids, rng.randint(1, 2))))
        elif roll < 0.08:
            # Groups inside the pipeline (picked when it happens), often just before an
            # interrupt: their blocks are released in the order they were aborted.
            events.append(("abort_in_flight", [rng.random() for _ in range(rng.randint(1, 3))]))
            if rng.random() < 0.5:
                events.append(("interrupt", None))
        elif roll < 0.095:
            events.append(("interrupt", None))
        elif roll < 0.105:
            events.append(("failure", None))
        elif roll < 0.4:
            # An interrupt while sequences that finished wait for a step to free their blocks
            # (decided on the reference's state, so for both alike).
            events.append(("interrupt_if_deferred", None))
    return w


def next_tokens(seq: Sequence, count: int, vocab: int) -> list[int]:
    """What the fake last stage samples for `seq`: a fixed function of its tokens."""
    base = sum(t * (i + 7) for i, t in enumerate(seq.get_token_ids()[-12:])) + seq.get_len()
    return [(base * 31 + 17 * k) % vocab + EOS for k in range(count)]


def beam_candidates(group: SequenceGroup, vocab: int) -> list[SequenceOutput]:
    """Two candidates per running beam and beam width, best cumulative logprob first."""
    width = group.sampling_params.best_of
    scored = []
    for seq in group.get_seqs(status=SequenceStatus.RUNNING):
        for k, token in enumerate(next_tokens(seq, 2 * width, vocab)):
            logprob = -((token * 7 + k * 3 + seq.get_len()) % 11) / 4.0
            scored.append((seq.get_cumulative_logprob() + logprob, seq.seq_id, token, logprob))
    scored.sort(key=lambda c: -c[0])  # stable: ties keep beam order
    return [
        SequenceOutput(seq_id, token, {token: Logprob(logprob)})
        for _, seq_id, token, logprob in scored[: 2 * width]
    ]


def fake_sampler_output(groups: list[SequenceGroup], vocab: int) -> list[SequenceGroupOutput]:
    outputs = []
    for group in groups:
        samples = []
        if group.sampling_params.use_beam_search and not (
            group.is_finished() or group.is_prefill()
        ):
            samples = beam_candidates(group, vocab)
        elif not group.is_finished() and not group.is_prefill():
            first = group.num_seqs() < group.sampling_params.best_of
            for seq in group.get_seqs(status=SequenceStatus.RUNNING):
                count = group.sampling_params.best_of if first else 1
                for token in next_tokens(seq, count, vocab):
                    samples.append(SequenceOutput(seq.seq_id, token, {token: Logprob(-1.0)}))
        outputs.append(SequenceGroupOutput(samples))
    return outputs


class Side:
    """One copy of the engine's loop around one scheduler (reference or live)."""

    def __init__(self, w: Workload, reference: bool) -> None:
        self.w = w
        self.reference = reference
        cache = CacheConfig(
            block_size=w.block_size,
            num_gpu_blocks=w.gpu_blocks,
            num_cpu_blocks=w.cpu_blocks,
            enable_prefix_caching=w.caching,
        )
        config = SchedulerConfig(
            max_num_batched_tokens=w.max_num_batched_tokens,
            max_num_seqs=w.max_num_seqs,
            max_model_len=w.max_model_len,
            preemption_mode=w.preemption_mode,
            enable_chunked_prefill=w.chunked,
        )
        self.scheduler: Any
        if reference:
            self.scheduler = ReferenceScheduler(config, cache, w.cohorts)
            self.scheduler.lookahead = w.lookahead
            self.scheduler.lookahead_gap = w.cohorts
        else:
            self.scheduler = make_live_scheduler(config, cache, w)
        self.seq_ids = iter(range(10**9))
        self.processor = OutputProcessor(
            self.scheduler, None, w.max_model_len, lambda: next(self.seq_ids)
        )
        self.max_batches = w.cohorts * (2 if w.lookahead else 1)
        self.batches: deque[tuple[Any, list[Any]]] = deque()
        # The batch queue's step numbers (restart after a stage failure).
        self.step_no = 0
        # Reference only: its batch numbers -> the step numbers they were submitted as.
        self.batch_steps: dict[int, int] = {}
        # Live only: what the first and last stages hold, built from the step records.
        self.table = RequestTable()

    def add(self, request: Request) -> None:
        seq = Sequence(
            next(self.seq_ids), None, list(request.prompt), self.w.block_size, eos_token_id=EOS
        )
        group = SequenceGroup(
            request.request_id, [seq], request.params.clone(), request.arrival_time
        )
        self.scheduler.add_seq_group(group)

    def schedule(self) -> tuple[list[Any], Any]:
        if self.reference:
            cap = None
            if self.w.cohorts > 1:
                cap = max(1, ceil_div(self.scheduler.num_active_seqs(), self.w.cohorts))
            metadata, out = self.scheduler.schedule(cap)
            if not out.is_empty():
                self.batch_steps[out.batch_no] = self.step_no + 1
        else:
            records, out = schedule_live(self.scheduler, self.step_no + 1)
            metadata = self.stage_rows(records, out)
        return metadata, out

    def stage_rows(self, records: list[Any], out: Any) -> list[Any]:
        """Live: commit the step (it is submitted unless empty) and apply its records to the
        stage's table; the rows, with the tokens fed for steps in flight stripped."""
        if out.is_empty():
            return []
        self.scheduler.commit_step(out)
        pending: dict[int, int] = {}
        for record in records:
            group = self.scheduler.in_flight[record.request_id]
            for seq in record.seqs:
                if isinstance(seq, CachedSeqData) and seq.num_pending:
                    # What the step in flight samples for it (as the last stage would record).
                    token = next_tokens(group.find(seq.seq_id), 1, self.w.vocab)[0]
                    self.table.record_sampled([(seq.seq_id, token)])
                    pending[seq.seq_id] = seq.num_pending
        rows = self.table.apply(StepMessage(records, out.step_no, reset=out.written.reset))
        for meta in rows.groups:
            meta.seq_data = {
                seq_id: _strip(data, pending.get(seq_id, 0))
                for seq_id, data in meta.seq_data.items()
            }
        return rows.groups

    def submit(self, out: Any, metadata: list[Any]) -> None:
        self.step_no += 1
        self.batches.append((out, metadata))

    def collect(self) -> None:
        out, _ = self.batches.popleft()
        groups = out.scheduled_seq_groups
        self.scheduler.finish_in_flight([g.request_id for g in groups])
        self.processor.process(groups, fake_sampler_output(groups, self.w.vocab))
        self.scheduler.free_finished_seq_groups()

    def interrupt(self) -> list[str]:
        self.batches.clear()  # the step numbers go on (BatchQueue.discard)
        return self.scheduler.requeue_in_flight()

    def failure(self) -> list[str]:
        self.batches.clear()
        self.step_no = 0  # BatchQueue.reset
        return self.scheduler.requeue_all()

    def in_flight(self) -> set[str]:
        return set(self.scheduler.in_flight)


# -- the live scheduler's construction and call (its API, in one place) ---------------------


def make_live_scheduler(config: SchedulerConfig, cache: CacheConfig, w: Workload) -> Scheduler:
    budget = MicroBatchBudget.from_config(config, w.cohorts)
    # The reference sends one chunk of a prompt at a time: chunked pipelining (several
    # chunks of one prompt in flight, tests/unit/test_chunked_prefill.py) is compared off.
    return Scheduler(config, cache, budget, schedule_ahead=w.lookahead, pipeline_chunks=False)


def schedule_live(sched: Scheduler, step_no: int) -> tuple[list[Any], Any]:
    return sched.schedule(step_no)


# -- comparison ------------------------------------------------------------------------------


def _ids(groups: Any) -> list[str]:
    return [g.request_id for g in groups]


def _group_state(group: SequenceGroup, tokens: bool) -> list[tuple[Any, ...]]:
    return [
        (
            s.seq_id,
            s.status,
            s.get_token_ids() if tokens else s.get_len(),
            s.data.get_num_computed_tokens(),
        )
        for s in group.get_seqs()
    ]


def _strip(data: SequenceData, num_pending: int) -> SequenceData:
    """A copy of the stage's sequence without the last `num_pending` tokens."""
    outputs = data.output_token_ids[: len(data.output_token_ids) - num_pending]
    return SequenceData(
        list(data.prompt_token_ids), outputs, data.cumulative_logprob, data.eos_token_id,
        data.get_num_computed_tokens(), data.stage, data.sample_index,
    )  # fmt: skip


def _metadata_state(meta: Any) -> dict[str, Any]:
    """Every field of a metadata record (SequenceData and SamplingParams compare by value)."""
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}


# SchedulerOutputs fields compared after mapping (group lists by request id, batch numbers).
# `written` (the live step records) is compared through the stage's rows.
_MAPPED = {
    "scheduled_seq_groups", "ignored_seq_groups", "ahead", "batch_no", "step_no", "written",
    "chunk_offsets", "drafts", "cost",
}  # fmt: skip


def compare(ref: Side, live: Side, ref_result: Any, live_result: Any, where: str) -> None:
    (ref_meta, ref_out), (live_meta, live_out) = ref_result, live_result
    assert _ids(live_out.scheduled_seq_groups) == _ids(ref_out.scheduled_seq_groups), where
    assert _ids(live_out.ignored_seq_groups) == _ids(ref_out.ignored_seq_groups), where
    ref_fields = {f.name for f in dataclasses.fields(ref_out)} - _MAPPED
    live_fields = {f.name for f in dataclasses.fields(live_out)} - _MAPPED
    assert live_fields == ref_fields, where
    # Chunked pipelining is off here: no chunk is ever written behind another in flight.
    assert not live_out.chunk_offsets, where
    # Speculation is off here: no decode verifies drafts.
    assert not live_out.drafts, where
    # The step's cost (the chunk sizer's input; the reference has none) counts its tokens.
    assert live_out.cost.tokens == live_out.num_batched_tokens, where
    for name in sorted(ref_fields):
        assert getattr(live_out, name) == getattr(ref_out, name), f"{where}: {name}"
    # The step a decode scheduled ahead feeds from, and the step number of the batch.
    ref_ahead = {rid: ref.batch_steps[b] for rid, b in ref_out.ahead.items()}
    assert live_out.ahead == ref_ahead, where
    expected_step = 0 if ref_out.is_empty() else ref.step_no + 1
    assert live_out.step_no == expected_step, where
    assert [_metadata_state(m) for m in live_meta] == [_metadata_state(m) for m in ref_meta], where
    compare_state(ref, live, where)


def compare_state(ref: Side, live: Side, where: str, tokens: bool = False) -> None:
    """The queues (with each sequence's status, length and computed tokens; its token ids
    with `tokens`, after new ones were appended), the groups in flight, the free and cached
    blocks, the KV bound and the counters."""
    r, s = ref.scheduler, live.scheduler
    for queue in ("waiting", "running", "swapped"):
        ref_q, live_q = getattr(r, queue), getattr(s, queue)
        assert _ids(live_q) == _ids(ref_q), f"{where}: {queue}"
        ref_state = [_group_state(g, tokens) for g in ref_q]
        assert [_group_state(g, tokens) for g in live_q] == ref_state, f"{where}: {queue}"
    assert live.in_flight() == ref.in_flight(), where
    bm_r, bm_s = r.block_manager, s.block_manager
    assert bm_s.get_num_free_gpu_blocks() == bm_r.get_num_free_gpu_blocks(), where
    assert bm_s.get_num_free_cpu_blocks() == bm_r.get_num_free_cpu_blocks(), where
    assert bm_s.get_num_cached_free_blocks() == bm_r.get_num_cached_free_blocks(), where
    assert s.kv_blocks_bound() == r.kv_blocks_bound(), where
    assert s.get_stats() == r.get_stats(), where


def run_workload(seed: int) -> int:
    """Drive both schedulers through one workload; returns the schedule() calls compared."""
    w = draw_workload(seed)
    ref, live = Side(w, reference=True), Side(w, reference=False)
    calls = 0
    for step in range(400):
        where = f"seed {seed} step {step}"
        for request in w.requests:
            if request.arrives == step:
                ref.add(request)
                live.add(request)
        for kind, arg in w.events.get(step, []):
            if kind == "abort_in_flight":
                in_flight = sorted(ref.in_flight())
                arg = [in_flight[int(x * len(in_flight))] for x in arg] if in_flight else []
                for request_id in arg:  # one by one: the order they are aborted in
                    ref.scheduler.abort_seq_group(request_id)
                    live.scheduler.abort_seq_group(request_id)
            elif kind == "abort":
                ref.scheduler.abort_seq_group(arg)
                live.scheduler.abort_seq_group(arg)
            elif kind == "interrupt_if_deferred":
                if ref.scheduler._deferred_free:
                    assert live.interrupt() == ref.interrupt(), where
            elif kind == "interrupt":
                assert live.interrupt() == ref.interrupt(), where
            else:
                assert live.failure() == ref.failure(), where
            compare_state(ref, live, f"{where} after {kind}")
        while len(ref.batches) < ref.max_batches:
            try:
                ref_result = ref.schedule()
            except RuntimeError as error:  # out of swap space: both must say so
                with pytest.raises(RuntimeError, match=str(error)):
                    live.schedule()
                return calls
            live_result = live.schedule()
            calls += 1
            compare(ref, live, ref_result, live_result, where)
            if ref_result[1].is_empty():
                break
            ref.submit(ref_result[1], ref_result[0])
            live.submit(live_result[1], live_result[0])
        if ref.batches:
            ref.collect()
            live.collect()
            compare_state(ref, live, f"{where} after collect", tokens=True)
        elif step > 30 and not ref.scheduler.has_unfinished_seqs():
            break
    return calls


@pytest.mark.parametrize("chunk", range(6))
def test_live_scheduler_decides_as_the_reference(chunk: int) -> None:
    seeds = range(chunk, NUM_SEEDS, 6)
    calls = sum(run_workload(seed) for seed in seeds)
    assert calls > 20 * len(seeds)  # the workloads do schedule (the test can fail)


def test_the_comparison_notices_a_difference() -> None:
    """A live scheduler that decides differently on one step is caught."""
    w = draw_workload(3)
    ref, live = Side(w, reference=True), Side(w, reference=False)
    for request in w.requests:
        ref.add(request)
        live.add(request)
    ref_result = ref.schedule()
    live_result = live.schedule()
    live_result[1].num_batched_tokens += 1
    with pytest.raises(AssertionError):
        compare(ref, live, ref_result, live_result, "tampered")
