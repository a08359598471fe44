"""Chunk sizing by step cost (torch-free): chunks shrink as a prompt goes on so each costs what
the first did, the cost ratio is fitted from step timings only when they explain it, the batch
queue times a step only when the pipeline was busy, and the scheduler cuts one long prompt's
chunks with the sizer and counts each step's attention pairs."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.utils.fake_requests import FakeParams
from tests.utils.fake_requests import seq_ids as _seq_ids
from tests.utils.stage_view import schedule_rows
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core import chunk_sizer
from vllm.core.budget import MicroBatchBudget
from vllm.core.chunk_sizer import ChunkSizer, StepCost, prior_pair_cost
from vllm.core.scheduler import Scheduler
from vllm.engine import batch_queue
from vllm.engine.batch_queue import BatchQueue
from vllm.executor.step_future import StepFuture
from vllm.sequence import Sequence, SequenceGroup

pytestmark = pytest.mark.fast

# SmolLM2-135M: hidden 576, 9 heads of 64, 3 KV heads, MLP 1536.
SMOL = prior_pair_cost(576 * (576 + 2 * 192) + 576 * 576 + 2 * 1536 * 576 + 1536 * 576, 9, 64)


def _cost(start: int, n: int, r: float) -> float:
    return n + r * StepCost.chunk_pairs(start, n)


def _chunks(sizer: ChunkSizer, length: int, room: int) -> list[int]:
    sizes, start = [], 0
    while start < length:
        sizes.append(sizer.chunk(start, length - start, room))
        start += sizes[-1]
    return sizes


def test_pairs_and_prior() -> None:
    # A chunk of 3 after 2 tokens: queries at 2, 3, 4 see 3, 4 and 5 keys.
    assert StepCost.chunk_pairs(2, 3) == 12
    assert StepCost.chunk_pairs(0, 1) == 1
    # SmolLM2: 4 * 576 flops a pair against 2 * ~3.5M a token.
    assert SMOL == pytest.approx(4 * 576 / (2 * 3_538_944))


def test_chunks_shrink_to_an_even_cost() -> None:
    sizer = ChunkSizer(SMOL)
    sizes = _chunks(sizer, 4096, 256)
    assert sum(sizes) == 4096
    assert sizes[0] == 256  # at position 0 a chunk takes the whole room
    assert all(a >= b for a, b in zip(sizes, sizes[1:-1]))  # shrinking (the last is the rest)
    assert sizes[-2] < 0.6 * 256  # attention over ~4k keys costs about as much again
    target = _cost(0, 256, SMOL)
    start = 0
    for n in sizes[:-1]:
        # Each costs the first chunk's cost, to within one more token.
        assert _cost(start, n, SMOL) <= target < _cost(start, n + 1, SMOL)
        start += n
    # Never more than is left or fits.
    assert sizer.chunk(3000, 10, 256) == 10 and sizer.chunk(3000, 500, 0) == 0
    # A bad ratio never shreds a prompt: at least an eighth of the room.
    assert ChunkSizer(1.0).chunk(4000, 4000, 512) == 64


def test_ratio_is_fitted_from_timings_that_explain_it() -> None:
    rng = random.Random(0)
    true_ratio = 3 * SMOL  # SDPA slower than the matmuls' arithmetic says
    sizer = ChunkSizer(SMOL)
    start = 0
    for _ in range(40):
        n = rng.randrange(64, 512)
        pairs = StepCost.chunk_pairs(start, n)
        seconds = 0.004 + 1e-4 * (n + true_ratio * pairs)
        sizer.observe(StepCost(n, pairs), seconds * rng.uniform(0.98, 1.02))
        start = (start + n) % 4000
    assert sizer.ratio == pytest.approx(true_ratio, rel=0.1)
    assert sizer.chunk(3000, 1000, 256) < ChunkSizer(SMOL).chunk(3000, 1000, 256)

    # Timings that explain nothing (a loaded machine) leave the prior alone.
    noisy = ChunkSizer(SMOL)
    for _ in range(40):
        n = rng.randrange(64, 512)
        noisy.observe(StepCost(n, StepCost.chunk_pairs(rng.randrange(4000), n)), rng.random())
    assert noisy.ratio == SMOL
    # The same chunk at the same place every step cannot tell the terms apart.
    same = ChunkSizer(SMOL)
    for _ in range(20):
        same.observe(StepCost(256, StepCost.chunk_pairs(0, 256)), 0.1 + rng.random() * 1e-3)
    assert same.ratio == SMOL
    # A far-off fit is held within MAX_DRIFT of the prior.
    far = ChunkSizer(SMOL)
    for i in range(20):
        n, start = 64 + 20 * i, 100 * i
        pairs = StepCost.chunk_pairs(start, n)
        far.observe(StepCost(n, pairs), 1e-4 * (n + 100 * SMOL * pairs))
    assert far.ratio == pytest.approx(SMOL * chunk_sizer.MAX_DRIFT)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Executor:
    def execute_model(self, request: Any, non_block: bool, num_tokens: int = 0) -> StepFuture:
        return StepFuture.completed([])

    def discard_steps(self) -> None:
        pass


class _Out:
    def __init__(self, step_no: int) -> None:
        self.step_no = step_no
        self.written = None
        self.ahead: dict[str, int] = {}
        self.blocks_to_swap_in: dict[int, int] = {}
        self.blocks_to_swap_out: dict[int, int] = {}
        self.blocks_to_copy: dict[int, list[int]] = {}
        self.num_batched_tokens = 1
        self.scheduled_seq_groups: list[Any] = []


def test_batch_queue_times_a_step_only_behind_a_busy_pipeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(batch_queue.time, "perf_counter", clock)
    queue = BatchQueue(_Executor(), pipeline_depth=2, async_pipeline=False)

    def submit() -> None:
        queue.submit(_Out(queue.next_step_no), [], [], 0)  # type: ignore[arg-type]

    submit()  # step 1 into an idle pipeline at t=0
    clock.now = 1.0
    submit()  # step 2 behind it
    clock.now = 3.0
    queue.collect_oldest()
    assert queue.last_step_s is None  # ran through an idle pipeline: every stage's time
    clock.now = 3.5
    submit()  # step 3, while step 2 is still in flight
    clock.now = 4.0
    queue.collect_oldest()  # step 2: submitted before step 1 came out
    assert queue.last_step_s == pytest.approx(1.0)
    clock.now = 4.25
    queue.collect_oldest()  # step 3: submitted before step 2 came out
    assert queue.last_step_s == pytest.approx(0.25)
    # One stage: the time from submission (or from the previous output, if later).
    single = BatchQueue(_Executor(), pipeline_depth=1, async_pipeline=False)
    clock.now = 10.0
    single.submit(_Out(single.next_step_no), [], [], 0)  # type: ignore[arg-type]
    clock.now = 10.5
    single.collect_oldest()
    assert single.last_step_s == pytest.approx(0.5)


def test_scheduler_cuts_one_long_prompt_with_the_sizer_and_counts_pairs() -> None:
    cache = CacheConfig(block_size=16, num_gpu_blocks=512, num_cpu_blocks=8)
    config = SchedulerConfig(
        max_num_batched_tokens=512,
        max_num_seqs=8,
        max_model_len=4200,
        enable_chunked_prefill=True,
    )
    sched = Scheduler(
        config,
        cache,
        MicroBatchBudget.from_config(config, cohorts=2),
        chunk_sizer=ChunkSizer(SMOL),
    )
    seq = Sequence(next(_seq_ids), "p", list(range(4096)), block_size=16)
    sched.add_seq_group(SequenceGroup("long", [seq], FakeParams(), arrival_time=0.0))
    starts, sizes = [], []
    start = 0
    for step_no in range(1, 200):
        rows, out = schedule_rows(sched, step_no=step_no)
        if not rows:
            break
        (row,) = rows
        sizes.append(row.token_chunk_size)
        starts.append(start)
        # The step's cost: its tokens, and the pairs of its chunk where it starts.
        assert out.cost == StepCost(row.token_chunk_size, StepCost.chunk_pairs(start, sizes[-1]))
        start += row.token_chunk_size
    # Every chunk in flight together (chunked pipelining), each a micro-batch's share of the
    # budget (256) at first, shrinking as the prompt goes on, covering it exactly.
    assert sum(sizes) == 4096 and sizes[0] == 256
    assert sizes == _chunks(ChunkSizer(SMOL), 4096, 256)
    assert sizes[-2] < 150
