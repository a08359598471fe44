"""Continuous batching with vLLM V0's FCFS policy, plus in-flight tracking for pipelining.

With pipeline parallelism the engine keeps several batches inside the pipeline at once; a group
that is in flight has not produced its next token yet, so it must not be scheduled, preempted or
swapped until the engine reports its batch back (`finish_in_flight`). Imports no torch.

Two policies, as in vLLM 0.5, each a mixin of `Scheduler` in its own module: by default a step
runs either new prompts (whole) or decodes (`vllm.core.classic_policy`); with
`enable_chunked_prefill` a step takes the running decodes first, then prefill chunks up to
`max_num_batched_tokens` (`vllm.core.chunked_policy`). This module keeps what both share: the
queues and in-flight tracking, `schedule()`, admission, the micro-batch cap, scheduling ahead,
preemption and the KV block bound. A group that can never fit the cache (a prompt, or a swapped
group that can never be swapped back in) is finished as FINISHED_IGNORED with a warning instead
of waiting forever.

Scheduling ahead (`lookahead`, the asynchronous pipeline): a decoding group whose step is in
flight may get its next step before that step's token comes back; the stages feed the token
they sampled themselves. A group is taken ahead only once `pipeline_parallel_size - 1` other
batches were submitted after its step, so the first stage runs the micro-batches round robin
and never waits for a token it cannot have yet. Blocks of a sequence that finishes while a
step of its group is still in flight are freed when that step comes back.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Callable, Collection, Iterable

from tests.unit.reference_scheduler.chunked_policy import ChunkedPolicy
from tests.unit.reference_scheduler.classic_policy import ClassicPolicy
from tests.unit.reference_scheduler.queue_heads import QueueHeads
from tests.unit.reference_scheduler.scheduler_types import SchedulerOutputs
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.block_manager import BlockSpaceManager
from vllm.sequence import Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus

__all__ = ["PreemptionMode", "Scheduler", "SchedulerOutputs"]

logger = logging.getLogger("vllm.core.scheduler")


class PreemptionMode(enum.Enum):
    """SWAP moves a victim's KV blocks to CPU swap space; RECOMPUTE drops them and re-prefills."""

    SWAP = enum.auto()
    RECOMPUTE = enum.auto()


class Scheduler(ClassicPolicy, ChunkedPolicy, QueueHeads):
    """Decides, step by step, which sequence groups run, and owns their KV blocks."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        pipeline_parallel_size: int = 1,
    ) -> None:
        if cache_config.num_gpu_blocks is None or cache_config.num_cpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks and num_cpu_blocks must be set.")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.pipeline_parallel_size = pipeline_parallel_size
        self.chunked_prefill = scheduler_config.enable_chunked_prefill
        # A prompt must fit the context window and, unless chunked, one step's token budget.
        self.prompt_limit = scheduler_config.max_model_len
        if not self.chunked_prefill:
            self.prompt_limit = min(self.prompt_limit, scheduler_config.max_num_batched_tokens)
        self.block_manager = BlockSpaceManager(
            cache_config.block_size,
            cache_config.num_gpu_blocks,
            cache_config.num_cpu_blocks,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.running: collections.deque[SequenceGroup] = collections.deque()
        self.swapped: collections.deque[SequenceGroup] = collections.deque()
        # Groups with at least one step inside the pipeline.
        self.in_flight: set[str] = set()
        self._in_flight_groups: dict[str, SequenceGroup] = {}
        # Per in-flight group, oldest first: (tokens the step feeds, its batch number).
        self._flights: dict[str, collections.deque[tuple[int, int]]] = {}
        # Sequences finished while a step of their group was in flight: freed on its return.
        self._deferred_free: dict[str, list[Sequence]] = {}
        self._batch_no = 0
        # Schedule decodes ahead of their in-flight step's output (set by the engine), once
        # `lookahead_gap - 1` other batches were submitted after that step.
        self.lookahead = False
        self.lookahead_gap = pipeline_parallel_size
        self._admitted = False
        # Aborted while in flight: their blocks are still being written by the pipeline.
        self._aborted_in_flight: dict[str, SequenceGroup] = {}
        self.num_cumulative_preemption = 0
        self._batch_cap = 1 << 62
        # See kv_blocks_bound(); recomputed when requests are admitted or swapped back in.
        self._kv_blocks_bound = 0

    # -- queue management ------------------------------------------------------------------

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        """Queue a new request (FCFS)."""
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_id: str | Iterable[str]) -> None:
        """Finish the groups' unfinished sequences as aborted and drop them from their queue."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for queue in (self.waiting, self.running, self.swapped):
            for seq_group in [g for g in queue if g.request_id in ids]:
                queue.remove(seq_group)
                ids.discard(seq_group.request_id)
                for seq in seq_group.get_unfinished_seqs():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                if seq_group.request_id in self.in_flight:
                    self._aborted_in_flight[seq_group.request_id] = seq_group
                else:
                    self._free_group(seq_group)

    def has_unfinished_seqs(self) -> bool:
        """Whether any group is waiting, running or swapped."""
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        """Number of groups waiting, running or swapped."""
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def fork_seq(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """Let a new sample or beam share its parent's KV blocks."""
        self.block_manager.fork(parent_seq, child_seq)

    def free_seq(self, seq: Sequence) -> None:
        """Release a (finished) sequence's KV blocks; if a step of its group is still in
        the pipeline (it was scheduled ahead), once that step comes back."""
        for request_id, group in self._in_flight_groups.items():
            if seq.seq_id in group.seqs_dict:
                self._deferred_free.setdefault(request_id, []).append(seq)
                return
        self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> None:
        """Drop finished groups from `running` (their sequences were freed by the engine)."""
        self.running = collections.deque(g for g in self.running if not g.is_finished())

    def finish_in_flight(self, request_ids: Iterable[str]) -> None:
        """The batch holding these groups left the pipeline: their tokens' KV is in the cache
        (counted as computed; full prompt blocks become shareable) and they may be scheduled
        again."""
        for request_id in request_ids:
            flights = self._flights.get(request_id)
            if not flights:
                continue
            num_tokens, _ = flights.popleft()
            group = self._in_flight_groups[request_id]
            if not flights:
                # Its last step is back: it may be scheduled, preempted or freed again.
                del self._flights[request_id]
                del self._in_flight_groups[request_id]
                self.in_flight.discard(request_id)
                for seq in self._deferred_free.pop(request_id, []):
                    self.block_manager.free(seq)
                aborted = self._aborted_in_flight.pop(request_id, None)
                if aborted is not None:
                    self._free_group(aborted)
                    continue
            if group.is_finished():
                continue
            running = group.get_seqs(status=SequenceStatus.RUNNING)
            for seq in running:
                if seq.is_prefill():
                    # Several sequences (diverged before a recompute) are never chunked.
                    if len(running) > 1:
                        num_tokens = seq.data.get_num_uncomputed_tokens()
                    seq.data.update_num_computed_tokens(num_tokens)
                    self.block_manager.mark_blocks_computed(seq, seq.data.get_num_computed_tokens())
                elif seq.data.get_num_uncomputed_tokens() > 0:
                    seq.data.update_num_computed_tokens(1)

    def get_stats(self) -> dict[str, float]:
        """Counters for metrics: preemptions so far and the prefix cache hit rate (-1 off)."""
        return {
            "num_cumulative_preemption": self.num_cumulative_preemption,
            "gpu_prefix_cache_hit_rate": self.block_manager.get_prefix_cache_hit_rate(),
        }

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (for a stage that lost its KV cache)."""
        self.block_manager.reset_prefix_cache()

    def requeue_in_flight(self) -> list[str]:
        """Put every group inside the pipeline back in the waiting queue for recompute.

        For a step whose result will never be processed (an interrupt while it ran, a lost
        stage): the KV it wrote may be partial, so the group re-prefills all its tokens,
        keeping the ones it already generated. Groups aborted while in flight are released.
        Returns the re-queued request ids."""
        for group in self._aborted_in_flight.values():
            self._free_group(group)
        self._aborted_in_flight.clear()
        for seqs in self._deferred_free.values():
            for seq in seqs:
                self.block_manager.free(seq)
        requeued = [g for g in self.running if g.request_id in self.in_flight]
        self.running = collections.deque(
            g for g in self.running if g.request_id not in self.in_flight
        )
        self._clear_flights()
        self._requeue(requeued, free_blocks=True)
        return [g.request_id for g in requeued]

    def requeue_all(self) -> list[str]:
        """Recompute everything: the KV cache of a stage was lost (it was replaced).

        Every running, in-flight or swapped group goes back to the waiting queue with the
        tokens it generated; all blocks (device and swap) are free afterwards. Returns the
        re-queued request ids."""
        self._aborted_in_flight.clear()
        self._clear_flights()
        groups = [g for g in (*self.running, *self.swapped) if not g.is_finished()]
        self.running.clear()
        self.swapped.clear()
        self.block_manager.reset()
        self._requeue(groups, free_blocks=False)
        return [g.request_id for g in groups]

    def _clear_flights(self) -> None:
        self.in_flight.clear()
        self._in_flight_groups.clear()
        self._flights.clear()
        self._deferred_free.clear()

    def _requeue(self, groups: list[SequenceGroup], free_blocks: bool) -> None:
        for group in groups:
            for seq in group.get_unfinished_seqs():
                if free_blocks:
                    self.block_manager.free(seq)
                seq.reset_for_recompute()
        # FCFS: the re-queued groups take their place by arrival among the waiting ones.
        merged = sorted([*groups, *self.waiting], key=lambda g: g.arrival_time)
        self.waiting = collections.deque(merged)
        self._kv_blocks_bound = self._bound_running_blocks()

    def _free_group(self, seq_group: SequenceGroup) -> None:
        for seq in seq_group.get_seqs():
            self.block_manager.free(seq)

    # -- scheduling ------------------------------------------------------------------------

    def num_active_seqs(self) -> int:
        """Sequences waiting, running (in flight or not) or swapped."""
        queues = (self.waiting, self.running, self.swapped)
        return sum(g.num_unfinished_seqs() for queue in queues for g in queue)

    def schedule(
        self, max_batch_seqs: int | None = None
    ) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
        """Pick the next batch; its groups stay in flight until `finish_in_flight`.

        `max_batch_seqs` caps this batch's sequences (at least one group is always taken):
        with pipelining the engine splits the work into micro-batches so every stage has one.
        """
        self._batch_cap = max_batch_seqs if max_batch_seqs is not None else 1 << 62
        self._admitted = False
        number = self._batch_no + 1
        outputs = self._schedule_chunked() if self.chunked_prefill else self._schedule()
        if self._admitted or outputs.blocks_to_swap_in:
            self._kv_blocks_bound = self._bound_running_blocks()
        if not outputs.is_empty():
            self._batch_no = outputs.batch_no = number
        metadata = []
        now = time.time()
        for seq_group in outputs.scheduled_seq_groups:
            seq_group.maybe_set_first_scheduled_time(now)
            seqs = seq_group.get_seqs(status=SequenceStatus.RUNNING)
            is_prompt = seq_group.is_prefill()
            chunk = outputs.token_chunk_sizes[seq_group.request_id]
            do_sample = True
            if is_prompt:
                data = seqs[0].data
                # A chunk that stops before the end of the prompt samples nothing.
                do_sample = data.get_num_computed_tokens() + chunk >= data.get_len()
            metadata.append(
                SequenceGroupMetadata(
                    request_id=seq_group.request_id,
                    is_prompt=is_prompt,
                    seq_data={seq.seq_id: seq.data for seq in seqs},
                    sampling_params=seq_group.sampling_params,
                    block_tables={
                        seq.seq_id: self.block_manager.get_block_table(seq) for seq in seqs
                    },
                    token_chunk_size=chunk if is_prompt else 1,
                    do_sample=do_sample,
                )
            )
            self.in_flight.add(seq_group.request_id)
            self._in_flight_groups[seq_group.request_id] = seq_group
            flight = (chunk if is_prompt else 1, number)
            self._flights.setdefault(seq_group.request_id, collections.deque()).append(flight)
        return metadata, outputs

    def _can_go_ahead(self, seq_group: SequenceGroup) -> bool:
        """Whether an in-flight group may get its next decode step now (see module doc)."""
        if not self.lookahead:
            return False
        flights = self._flights.get(seq_group.request_id)
        if flights is None or len(flights) != 1:
            return False
        _, batch_no = flights[0]
        if self._batch_no + 1 - batch_no < self.lookahead_gap:
            return False  # the first stage would wait for that step's token
        params = seq_group.sampling_params
        if params.use_beam_search or seq_group.num_seqs() < params.best_of:
            return False  # the output processor picks or forks sequences from the samples
        seqs = seq_group.get_seqs(status=SequenceStatus.RUNNING)
        if not seqs or any(seq.is_prefill() for seq in seqs):
            return False
        max_len = self.scheduler_config.max_model_len
        # The step in flight may produce the last token: never run one past a known stop.
        return all(
            seq.get_output_len() + 1 < (params.max_tokens or max_len)
            and seq.get_len() + 1 < max_len
            for seq in seqs
        )

    def _schedule_ahead(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> bool:
        """Schedule an in-flight group's next decode if its slots fit (never preempts)."""
        if not self.block_manager.can_append_slots(seq_group):
            return False
        for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
            for src, dst in self.block_manager.append_slots(seq, num_lookahead_slots=1):
                out.blocks_to_copy.setdefault(src, []).append(dst)
        out.ahead[seq_group.request_id] = self._flights[seq_group.request_id][0][1]
        return True

    def kv_blocks_bound(self) -> int:
        """A bound on the device block ids the admitted requests can reach before the next
        admission: the blocks of every running sequence at its longest, plus the free blocks
        that still hold prefix-cache KV.

        The block manager hands out the lowest free block first (a cached block is reused
        only when no other is free), so a block id never reaches the peak number of blocks in
        use or cached, which these cannot exceed. Workers use
        it to map and zero their cache ahead of the writes (CacheEngine.reserve)."""
        return self._kv_blocks_bound

    def _bound_running_blocks(self) -> int:
        max_model_len = self.scheduler_config.max_model_len
        block_size = self.cache_config.block_size
        total = 0
        for group in self.running:
            max_tokens = group.sampling_params.max_tokens
            # Sequences still to fork (best_of) count like the one they fork from.
            seqs = max(group.num_seqs(), group.get_max_num_running_seqs())
            longest = max(
                min(seq.get_prompt_len() + (max_tokens or max_model_len), max_model_len)
                for seq in group.get_seqs()
            )
            total += seqs * -(-longest // block_size)
        # Parked prefix-cache blocks keep their ids until they are evicted.
        total += self.block_manager.get_num_cached_free_blocks()
        # Blocks taken when more were in use may sit above that sum.
        total = max(total, self.block_manager.gpu_high_water())
        return min(total, self.block_manager.num_total_gpu_blocks)

    # -- shared by both policies (vllm.core.classic_policy, vllm.core.chunked_policy) -----

    def _num_running_seqs(self) -> int:
        # In-flight groups keep their slots: they come back for more tokens.
        return sum(g.get_max_num_running_seqs() for g in self.running)

    def _batch_full(
        self, scheduled: Collection[SequenceGroup], batch_seqs: int, num_seqs: int
    ) -> bool:
        """Whether `num_seqs` more sequences would pass this micro-batch's cap (`schedule`'s
        `max_batch_seqs`), `batch_seqs` being taken; a batch's first group always fits."""
        return bool(scheduled) and batch_seqs + num_seqs > self._batch_cap

    def _grow_or_preempt(
        self,
        seq_group: SequenceGroup,
        out: SchedulerOutputs,
        next_victim: Callable[[], SequenceGroup | None],
    ) -> bool:
        """Make room for the group's next tokens by preempting lower-priority groups (from
        `next_victim`) and append its slots; True if it runs, False if it had to be
        preempted itself because no victim was left."""
        while not self.block_manager.can_append_slots(seq_group):
            victim = next_victim()
            if victim is None:
                self._preempt(seq_group, out)
                return False
            self._preempt(victim, out)
        self._append_slots(seq_group, out)
        return True

    def _append_slots(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
            for src, dst in self.block_manager.append_slots(seq):
                out.blocks_to_copy.setdefault(src, []).append(dst)

    def _preempt(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        mode = self._preemption_mode(seq_group)
        if mode == PreemptionMode.RECOMPUTE:
            for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
                seq.reset_for_recompute()
                self.block_manager.free(seq)
            self.waiting.appendleft(seq_group)
        else:
            if not self.block_manager.can_swap_out(seq_group):
                raise RuntimeError(
                    "Aborted due to the lack of CPU swap space. Please increase the swap space "
                    "to avoid this error."
                )
            out.blocks_to_swap_out.update(self.block_manager.swap_out(seq_group))
            for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq_group)
        out.num_preempted += 1
        self.num_cumulative_preemption += 1
        seq_group.num_preemptions += 1
        # The first preemption and every 50th after: visible without flooding the log.
        if self.num_cumulative_preemption % 50 == 1:
            logger.warning(
                "Sequence group %s is preempted by %s mode because there is not enough KV "
                "cache space. This can affect the end-to-end performance. Increase "
                "gpu_memory_utilization or kv_cache_space to provide more KV cache memory. "
                "total_num_cumulative_preemption=%d",
                seq_group.request_id,
                mode,
                self.num_cumulative_preemption,
            )

    def _preemption_mode(self, seq_group: SequenceGroup) -> PreemptionMode:
        configured = self.scheduler_config.preemption_mode
        # Several diverged sequences cannot be re-prefilled as one shared prompt, so such a
        # group is always swapped (vLLM V0 asserts instead).
        if seq_group.num_seqs(status=SequenceStatus.RUNNING) > 1:
            return PreemptionMode.SWAP
        if configured == "swap":
            return PreemptionMode.SWAP
        if configured == "recompute":
            return PreemptionMode.RECOMPUTE
        if seq_group.get_max_num_running_seqs() == 1:
            return PreemptionMode.RECOMPUTE
        return PreemptionMode.SWAP
