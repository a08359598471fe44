"""Continuous batching with vLLM V0's FCFS policies, plus in-flight tracking for pipelining.

`Scheduler` owns the queues (waiting, running, swapped), admission, swap-in, preemption and
the KV block bound, and each `schedule()` dispatches to one policy object: by default a step
runs either new prompts (whole) or decodes (`vllm.core.classic_policy`); with
`enable_chunked_prefill` a step takes the running decodes first, then prefill chunks
(`vllm.core.chunked_policy`). How large one batch may be is the engine's `MicroBatchBudget`.
A group that can never fit the cache (a prompt, or a swapped group that can never be swapped
back in) is finished as FINISHED_IGNORED with a warning instead of waiting forever. Each
step is written once, as records for the first and last stages (`vllm.core.step_writer`:
a request in full when they do not hold it, else what changed), committed by `commit_step`
once the executor accepted it. Imports no torch.

One writer per queue: `waiting`, `running`, `swapped` and the in-flight index are written in
this module only. A policy reads them through `PolicyQueues` (`vllm.core.policy_api`) and a
stage rollback through `RollbackQueues` (`vllm.core.stage_rollback`); both decide, and the
scheduler's methods apply their decisions (tests/unit/test_queue_writers.py keeps it so).

In flight: with pipeline parallelism the engine keeps several batches inside the pipeline at
once; a group in flight has not produced its next token yet, so it is not scheduled, preempted
or swapped until the engine reports its batch back (`finish_in_flight`). The facts of each
step in flight live on its `SequenceGroup` (`flights`, `abort_pending`, `deferred_free`);
the scheduler keeps only the index of the groups that have one (`in_flight`).

Scheduling ahead (`schedule_ahead`, the asynchronous pipeline): a decoding group whose step is
in flight may get its next step before that step's token comes back; the stages feed the token
they sampled themselves. A group is taken ahead only once `cohorts - 1` other batches were
submitted after its step, so the first stage runs the micro-batches round robin and never
waits for a token it cannot have yet. Blocks of a sequence that finishes while a step of its
group is still in flight are freed when that step comes back.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Callable, Iterable

from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.block_manager import AllocStatus, BlockSpaceManager
from vllm.core.budget import NO_CAP, MicroBatchBudget
from vllm.core.chunk_sizer import ChunkSizer, StepCost
from vllm.core.chunked_policy import ChunkedPolicy
from vllm.core.classic_policy import ClassicPolicy
from vllm.core.lora_admission import LoRAAdmission
from vllm.core.partial_prefills import PartialPrefillLimits
from vllm.core.policy_api import SchedulerOutputs
from vllm.core.step_writer import StepWriter
from vllm.sequence import Flight, Sequence, SequenceGroup, SequenceStatus
from vllm.spec_decode.planner import DraftPlanner
from vllm.step_records import RequestRecord
from vllm.utils import ceil_div

__all__ = ["PreemptionMode", "Scheduler", "SchedulerOutputs"]

logger = logging.getLogger("vllm.core.scheduler")


class PreemptionMode(enum.Enum):
    """SWAP moves a victim's KV blocks to CPU swap space; RECOMPUTE drops them and re-prefills."""

    SWAP = enum.auto()
    RECOMPUTE = enum.auto()


class Scheduler:
    """Decides, step by step, which sequence groups run, and owns their KV blocks.

    `budget` sizes each batch (default: the config's limits, one micro-batch); with
    `schedule_ahead` a decode may be scheduled while its previous step is in flight, once
    `budget.cohorts - 1` other steps were submitted after that one."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        budget: MicroBatchBudget | None = None,
        schedule_ahead: bool = False,
        max_loras: int | None = None,
        pipeline_chunks: bool = True,
        draft_planner: DraftPlanner | None = None,
        chunk_sizer: ChunkSizer | None = None,
    ) -> None:
        if cache_config.num_gpu_blocks is None or cache_config.num_cpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks and num_cpu_blocks must be set.")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.configure_pipelining(
            budget or MicroBatchBudget.from_config(scheduler_config), schedule_ahead
        )
        # Chunked pipelining: a prompt's next chunk may be scheduled while earlier ones are in
        # flight (see `can_pipeline_chunk`).
        self.pipeline_chunks = pipeline_chunks
        # Speculative decoding (None: off): proposes the drafts of the scheduled decodes;
        # whether the step being scheduled speculates (the planner may pause it).
        self.draft_planner = draft_planner
        self._speculate = False
        # How many distinct LoRA adapters the running groups may use (None: no LoRA).
        self.lora_admission = LoRAAdmission(max_loras)
        # Sizes prompt chunks to an even step cost (None: fixed-size chunks); fed each
        # finished step's duration by the engine.
        self.chunk_sizer = chunk_sizer
        chunked = scheduler_config.enable_chunked_prefill
        self.policy: ClassicPolicy | ChunkedPolicy = (
            ChunkedPolicy(
                self,
                scheduler_config.prefill_token_cap,
                chunk_sizer,
                PartialPrefillLimits.from_config(scheduler_config),
            )
            if chunked
            else ClassicPolicy(self)
        )
        self.block_manager = BlockSpaceManager(
            cache_config.block_size,
            cache_config.num_gpu_blocks,
            cache_config.num_cpu_blocks,
            enable_caching=cache_config.enable_prefix_caching,
        )
        # Writes each step's records from what the stages hold (facts kept on the requests).
        self.step_writer = StepWriter(self.block_manager)
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.running: collections.deque[SequenceGroup] = collections.deque()
        self.swapped: collections.deque[SequenceGroup] = collections.deque()
        # The groups with at least one step inside the pipeline (also those aborted since:
        # they left the queues, their blocks wait for the step), by request id.
        self.in_flight: dict[str, SequenceGroup] = {}
        # Whether this step admitted a new group (the KV block bound then moves).
        self._admitted = False
        self.num_cumulative_preemption = 0
        # See kv_blocks_bound(); recomputed when requests are admitted or swapped back in.
        self._kv_blocks_bound = 0

    # -- queues ----------------------------------------------------------------------------

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
                if seq_group.is_in_flight():
                    # The pipeline may still write its blocks: freed when the step is back.
                    seq_group.abort_pending = True
                    self._index_last(seq_group)
                else:
                    self._free_group(seq_group)

    def has_unfinished_seqs(self) -> bool:
        """Whether any group is waiting, running or swapped."""
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        """Number of groups waiting, running or swapped."""
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def num_active_seqs(self) -> int:
        """Sequences waiting, running (in flight or not) or swapped."""
        queues = (self.waiting, self.running, self.swapped)
        return sum(g.num_unfinished_seqs() for queue in queues for g in queue)

    def fork_seq(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """Let a new sample or beam share its parent's KV blocks."""
        self.block_manager.fork(parent_seq, child_seq)

    def free_seq(self, seq: Sequence) -> None:
        """Release a (finished) sequence's KV blocks; if a step of its group is still in
        the pipeline (it was scheduled ahead), once that step comes back."""
        for group in self.in_flight.values():
            if seq.seq_id in group.seqs_dict:
                if not group.deferred_free:
                    self._index_last(group)
                group.deferred_free.append(seq)
                return
        self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> None:
        """Drop finished groups from `running` (their sequences were freed by the engine)."""
        self.running = collections.deque(g for g in self.running if not g.is_finished())

    def get_stats(self) -> dict[str, float]:
        """Counters for metrics: preemptions so far and the prefix cache hit rate (-1 off)."""
        return {
            "num_cumulative_preemption": self.num_cumulative_preemption,
            "gpu_prefix_cache_hit_rate": self.block_manager.get_prefix_cache_hit_rate(),
        }

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (for a stage that lost its KV cache)."""
        self.block_manager.reset_prefix_cache()

    # -- in flight -------------------------------------------------------------------------

    def finish_in_flight(self, request_ids: Iterable[str]) -> None:
        """The batch holding these groups left the pipeline: their tokens' KV is in the cache
        (counted as computed; full prompt blocks become shareable) and they may be scheduled
        again."""
        for request_id in request_ids:
            group = self.in_flight.get(request_id)
            if group is None:
                continue
            num_tokens = group.flights.popleft().num_tokens
            if not group.flights:
                # Its last step is back: it may be scheduled, preempted or freed again.
                del self.in_flight[request_id]
                deferred, group.deferred_free = group.deferred_free, []
                for seq in deferred:
                    self.block_manager.free(seq)
                if group.abort_pending:
                    group.abort_pending = False
                    self._free_group(group)
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

    def configure_pipelining(self, budget: MicroBatchBudget, schedule_ahead: bool) -> None:
        """One batch's budget and whether decodes are scheduled ahead: at start, and again
        when the pipeline changed size (nothing in flight then)."""
        self.budget = budget
        self.schedule_ahead = schedule_ahead
        # A prompt must fit the context window and, unless chunked, one step's token budget.
        self.prompt_limit = self.scheduler_config.max_model_len
        if not self.scheduler_config.enable_chunked_prefill:
            self.prompt_limit = min(self.prompt_limit, budget.max_num_batched_tokens)

    def requeue_in_flight(self) -> list[str]:
        """Put every group inside the pipeline back in the waiting queue for recompute.

        For a step whose result will never be processed (an interrupt while it ran, a lost
        stage): the KV it wrote may be partial, so the group re-prefills all its tokens,
        keeping the ones it already generated. Groups aborted while in flight are released.
        Returns the re-queued request ids."""
        requeued = [g for g in self.running if g.is_in_flight()]
        self.drop_steps_in_flight()
        self.requeue(requeued)
        return [g.request_id for g in requeued]

    def drop_steps_in_flight(self) -> None:
        """The steps inside the pipeline will never come back: the stages forget every
        request (they re-learn it in full), the blocks those steps held back are freed, and
        their groups stay where their last collected step left them."""
        self.step_writer.forget_all()
        self._free_held_by_flights()
        self._clear_flights()

    def requeue(self, groups: list[SequenceGroup]) -> None:
        """Recompute `groups`: taken out of `running` or `swapped` (if still there), their
        blocks are freed and they wait again, by arrival, with the tokens they have."""
        self.set_aside(groups)
        self._requeue(groups, free_blocks=True)

    def set_aside(self, groups: Iterable[SequenceGroup]) -> None:
        """Take `groups` out of `running` and `swapped` keeping their blocks, for a rollback
        that requeues them once it has decided every group (`requeue`) or drops them
        (finished)."""
        ids = {g.request_id for g in groups}
        if ids:
            self.running = collections.deque(g for g in self.running if g.request_id not in ids)
            self.swapped = collections.deque(g for g in self.swapped if g.request_id not in ids)

    def swap_in_for_replay(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Bring a swapped group back into `running` outside a step (a rollback replays its
        committed tokens): its sequences run again; returns {cpu block: gpu block}."""
        self.swapped.remove(seq_group)
        blocks = self.block_manager.swap_in(seq_group)
        for seq in seq_group.get_seqs(status=SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.RUNNING
        self.running.append(seq_group)
        return blocks

    def recompute_groups(self, groups: list[SequenceGroup]) -> None:
        """Recompute running groups that are not in flight from their first token (a pooling
        request whose last stage lost its earlier chunks): blocks freed, sent in full again."""
        for group in groups:
            StepWriter.forget(group)
        self.requeue(groups)

    def requeue_all(self) -> list[str]:
        """Recompute everything: the KV cache of a stage was lost (it was replaced).

        Every running, in-flight or swapped group goes back to the waiting queue with the
        tokens it generated; all blocks (device and swap) are free afterwards. Returns the
        re-queued request ids."""
        self.step_writer.forget_all()  # new stages hold nothing
        self._clear_flights()
        groups = [g for g in (*self.running, *self.swapped) if not g.is_finished()]
        self.running.clear()
        self.swapped.clear()
        self.block_manager.reset()
        self._requeue(groups, free_blocks=False)
        return [g.request_id for g in groups]

    def resize_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The stages' caches were re-made with these block counts (a layer re-split).
        Only between `requeue_all` and the next schedule: no group holds a block."""
        if self.running or self.swapped or self.in_flight:
            raise RuntimeError("resize_kv_cache: groups still hold blocks; requeue_all first")
        self.block_manager.resize(num_gpu_blocks, num_cpu_blocks)
        self._kv_blocks_bound = self._bound_running_blocks()

    def shrink_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> str | None:
        """The stages' caches will hold fewer blocks, keeping the groups' blocks (a stage
        took over a lost neighbour's layers): None when done, else why not (nothing
        changed). Only with nothing in flight."""
        if self.in_flight:
            raise RuntimeError("shrink_kv_cache: steps in flight")
        why = self.block_manager.shrink(num_gpu_blocks, num_cpu_blocks)
        if why is None:
            self._kv_blocks_bound = self._bound_running_blocks()
        return why

    def _index_last(self, group: SequenceGroup) -> None:
        """Move an in-flight group to the end of `in_flight`, which thus lists the aborted
        groups in the order they were aborted, and the groups with deferred frees in the
        order of their first one: `requeue_in_flight` releases blocks in these orders, and
        with prefix caching the order blocks are freed in is the order they are evicted in."""
        self.in_flight[group.request_id] = self.in_flight.pop(group.request_id)

    def _free_held_by_flights(self) -> None:
        """The steps in flight will never come back: free the blocks they held back (groups
        aborted while in flight, sequences that finished meanwhile), in `in_flight` order."""
        groups = list(self.in_flight.values())
        for group in groups:
            if group.abort_pending:
                self._free_group(group)
        for group in groups:
            for seq in group.deferred_free:
                self.block_manager.free(seq)

    def _clear_flights(self) -> None:
        for group in self.in_flight.values():
            group.clear_flights()
        self.in_flight.clear()

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

    # -- one step --------------------------------------------------------------------------

    def schedule(self, step_no: int = 0) -> tuple[list[RequestRecord], SchedulerOutputs]:
        """Pick the next batch, to be submitted as step `step_no` (`BatchQueue.next_step_no`;
        needed to schedule ahead); its groups stay in flight until `finish_in_flight`.

        Returns the step's records, one per scheduled group (written once, see
        `vllm.core.step_writer`), and the decisions; `commit_step` once it was sent."""
        if self.schedule_ahead and step_no < 1:
            raise ValueError(f"step_no must be >= 1 to schedule ahead, got {step_no}.")
        self._admitted = False
        out = SchedulerOutputs()
        seq_cap = NO_CAP  # one cohort: no need to count the active sequences
        if self.budget.cohorts > 1:
            seq_cap = self.budget.max_batch_seqs(self.num_active_seqs())
        planner = self.draft_planner
        self._speculate = planner is not None and planner.begin_step(self.num_running_seqs())
        self.policy.schedule(out, seq_cap, step_no)
        if self._speculate:
            self._plan_drafts(out)
        if self._admitted or out.blocks_to_swap_in:
            self._kv_blocks_bound = self._bound_running_blocks()
        if not out.is_empty():
            out.step_no = step_no
        now = time.time()
        pairs = 0
        for seq_group in out.scheduled_seq_groups:
            seq_group.maybe_set_first_scheduled_time(now)
            chunk = out.token_chunk_sizes[seq_group.request_id]
            if offset := seq_group.prefill_tokens_in_flight():
                out.chunk_offsets[seq_group.request_id] = offset
            if self.chunk_sizer is not None:  # only the sizer reads the pairs
                pairs += _attention_pairs(seq_group, chunk, offset, out.drafts)
            speculative = seq_group.request_id in out.drafts
            seq_group.flights.append(
                Flight(chunk if seq_group.is_prefill() else 1, step_no, speculative)
            )
            self.in_flight[seq_group.request_id] = seq_group
        out.cost = StepCost(out.num_batched_tokens, pairs)
        out.written = self.step_writer.write(
            out.scheduled_seq_groups,
            out.token_chunk_sizes,
            out.ahead,
            out.chunk_offsets,
            out.drafts,
        )
        return out.written.records, out

    def _plan_drafts(self, out: SchedulerOutputs) -> None:
        """Speculation: drafts for the step's decodes (not those scheduled ahead), within the
        step's token budget and the free blocks (a draft needs its slot), never preempting."""
        planner = self.draft_planner
        assert planner is not None
        room = self.budget.max_num_batched_tokens - out.num_batched_tokens
        candidates = [
            (group, seq)
            for group in out.scheduled_seq_groups
            if not group.is_prefill() and group.request_id not in out.ahead
            for seq in group.get_seqs(status=SequenceStatus.RUNNING)
        ]
        if room <= 0 or not candidates:
            return
        used = 0
        bm = self.block_manager
        for (group, seq), drafts in zip(candidates, planner.propose(candidates)):
            drafts = drafts[: room - used]
            free = bm.get_num_free_gpu_blocks()
            while drafts and bm.lookahead_cost(seq, len(drafts)) > free:
                drafts.pop()
            if not drafts:
                continue
            for src, dst in bm.append_slots(seq, num_lookahead_slots=len(drafts)):
                out.blocks_to_copy.setdefault(src, []).append(dst)
            out.drafts.setdefault(group.request_id, {})[seq.seq_id] = drafts
            used += len(drafts)
        out.num_batched_tokens += used

    def _would_speculate(self, seq_group: SequenceGroup) -> bool:
        """Whether a decoding group in flight has drafts on the tokens known now: then its
        next step waits for that token and speculates rather than going ahead without."""
        planner = self.draft_planner
        assert planner is not None
        return any(
            planner.would_speculate(seq_group, seq)
            for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING)
        )

    def commit_step(self, out: SchedulerOutputs) -> None:
        """The executor accepted the step `out` was scheduled for: what it told the stages is
        what they hold now (see `StepWriter.commit`)."""
        if out.written is not None:
            self.step_writer.commit(out.written)

    # -- scheduling ahead (both policies) ---------------------------------------------------

    def can_go_ahead(self, seq_group: SequenceGroup, step_no: int) -> bool:
        """Whether an in-flight group may get its next decode step as step `step_no` now."""
        if not self.schedule_ahead or len(seq_group.flights) != 1:
            return False
        if seq_group.flights[0].speculative:
            return False  # how many tokens that step yields is known only when it is back
        if self._speculate and self._would_speculate(seq_group):
            return False  # better: wait for the token, then verify drafts after it
        if step_no - seq_group.flights[0].step_no < self.budget.cohorts:
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

    def can_pipeline_chunk(self, seq_group: SequenceGroup) -> bool:
        """Whether an in-flight group may get the next chunk of its prompt now (chunked
        pipelining): chunk k+1 may enter a stage once chunk k has been processed there, and
        every stage runs the steps in the order they were submitted, so submitting it after
        chunk k is enough. Only a single prefilling sequence with prompt tokens not yet
        scheduled (its blocks were allocated at admission); never an aborted group. With
        one micro-batch there is never a second step in flight to fill."""
        if not self.pipeline_chunks or self.budget.cohorts < 2:
            return False
        if seq_group.abort_pending or seq_group.is_finished():
            return False
        seqs = seq_group.get_seqs(status=SequenceStatus.RUNNING)
        if len(seqs) != 1 or not seqs[0].is_prefill():
            return False
        return seqs[0].get_num_new_tokens() > seq_group.prefill_tokens_in_flight()

    def try_schedule_ahead(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> bool:
        """Schedule an in-flight group's next decode if its slots fit (never preempts)."""
        if not self.block_manager.can_append_slots(seq_group):
            return False
        for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
            for src, dst in self.block_manager.append_slots(seq, num_lookahead_slots=1):
                out.blocks_to_copy.setdefault(src, []).append(dst)
        out.ahead[seq_group.request_id] = seq_group.flights[0].step_no
        return True

    # -- admission (both policies) ---------------------------------------------------------

    def num_running_seqs(self) -> int:
        """Sequences the running groups may have (in-flight groups keep their slots: they
        come back for more tokens)."""
        return sum(g.get_max_num_running_seqs() for g in self.running)

    def next_admissible(
        self, out: SchedulerOutputs, passed_over: Callable[[SequenceGroup], bool] | None = None
    ) -> tuple[SequenceGroup, list[Sequence], int] | None:
        """The first waiting group if it can be admitted now: (group, its waiting sequences,
        their tokens -- a recomputed group re-prefills its generated tokens as well). Groups
        for which `passed_over` is true are skipped, keeping their places (a long prompt
        while enough long ones run, `vllm.core.partial_prefills`); groups that can never fit
        are finished as ignored on the way; None when that group must wait or nothing is
        left. The group stays in `waiting` until `admit`."""
        index = 0
        while index < len(self.waiting):
            seq_group = self.waiting[index]
            if passed_over is not None and passed_over(seq_group):
                index += 1
                continue
            waiting_seqs = seq_group.get_seqs(status=SequenceStatus.WAITING)
            num_prompt_tokens = sum(seq.get_len() for seq in waiting_seqs)
            admission = self._admission(seq_group, num_prompt_tokens, out)
            if admission is AllocStatus.LATER:
                return None
            if admission is AllocStatus.OK:
                return seq_group, waiting_seqs, num_prompt_tokens
        return None

    def _leave_waiting(self, seq_group: SequenceGroup) -> None:
        # Almost always the head; a prompt admitted past a long one is further back.
        if self.waiting[0] is seq_group:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq_group)

    def admit(self, seq_group: SequenceGroup, waiting_seqs: list[Sequence]) -> None:
        """Take `seq_group` (from `next_admissible`) out of `waiting` into `running` with its
        blocks (a cached prefix is counted as computed)."""
        self._leave_waiting(seq_group)
        cached = self.block_manager.allocate(seq_group)
        for seq in waiting_seqs:
            seq.status = SequenceStatus.RUNNING
            if cached:
                seq.data.update_num_computed_tokens(cached)
        self.running.append(seq_group)
        self._admitted = True

    def ignore(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        """End `seq_group` (from `next_admissible`), which can never run, as
        FINISHED_IGNORED."""
        for seq in seq_group.get_seqs(status=SequenceStatus.WAITING):
            seq.status = SequenceStatus.FINISHED_IGNORED
        out.ignored_seq_groups.append(seq_group)
        self._leave_waiting(seq_group)

    def _over_prompt_limit(self, seq_group: SequenceGroup, num_prompt_tokens: int) -> bool:
        """Whether the waiting group can never be prefilled. With chunked prefill each sequence
        must fit the context window: samples that diverged before a recompute each re-prefill
        their own tokens (their sum may pass max_model_len; the chunked policy checks it against
        the step's tokens). Without it, all of them must fit one step."""
        if not self.scheduler_config.enable_chunked_prefill:
            return num_prompt_tokens > self.prompt_limit
        waiting = seq_group.get_seqs(status=SequenceStatus.WAITING)
        return max((seq.get_len() for seq in waiting), default=0) > self.prompt_limit

    def _admission(
        self, seq_group: SequenceGroup, num_prompt_tokens: int, out: SchedulerOutputs
    ) -> AllocStatus:
        """Whether the first waiting group can be admitted now (OK), must wait (LATER: no
        blocks yet, or its prefix is being computed in flight and it waits to reuse it), or
        never fits (NEVER: it was finished as ignored, with vLLM's warning)."""
        if self._over_prompt_limit(seq_group, num_prompt_tokens):
            logger.warning(
                "Input prompt (%d tokens) is too long and exceeds limit of %d",
                num_prompt_tokens,
                self.prompt_limit,
            )
            self.ignore(seq_group, out)
            return AllocStatus.NEVER
        if not self.lora_admission.allows(seq_group, self.running):
            return AllocStatus.LATER  # its adapter needs a slot the running groups hold
        status = self.block_manager.can_allocate(seq_group)
        if status == AllocStatus.LATER or self.block_manager.prefix_pending(seq_group):
            return AllocStatus.LATER
        if status == AllocStatus.NEVER:
            logger.warning(
                "Input prompt (%d tokens) is too long and exceeds the capacity of block_manager",
                num_prompt_tokens,
            )
            self.ignore(seq_group, out)
        return status

    # -- swap-in (both policies) -----------------------------------------------------------

    def sort_swapped(self) -> None:
        """FCFS order of the swapped groups (earliest arrival first)."""
        self.swapped = collections.deque(sorted(self.swapped, key=lambda g: g.arrival_time))

    def sort_running(self, key: Callable[[SequenceGroup], tuple[int, float]]) -> None:
        """Order `running` by a policy's priority (stable: equal keys keep their order). The
        policy then walks it; a group it preempts leaves it, one admitted or swapped in joins
        its end."""
        self.running = collections.deque(sorted(self.running, key=key))

    def next_swappable(self, out: SchedulerOutputs, num_seqs: int) -> SequenceGroup | None:
        """The first swapped group if it can come back now (blocks free, and room for its
        sequences next to the `num_seqs` running). Groups that can never come back are
        finished as ignored on the way; None when the head must wait or nothing is swapped."""
        while self.swapped:
            seq_group = self.swapped[0]
            status = self.block_manager.can_swap_in(seq_group)
            if status == AllocStatus.NEVER:
                self._ignore_swapped(seq_group, out)
                continue
            if status == AllocStatus.LATER:
                return None
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if num_seqs + num_new_seqs > self.budget.max_num_seqs:
                return None
            if not self.lora_admission.allows(seq_group, self.running):
                return None
            return seq_group
        return None

    def swap_in(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        """Bring the head of `swapped` back: its blocks in (applied before the step), its
        sequences running, a slot for the step's token, and into `running`."""
        self.swapped.popleft()
        out.blocks_to_swap_in.update(self.block_manager.swap_in(seq_group))
        for seq in seq_group.get_seqs(status=SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.RUNNING
        self._append_slots(seq_group, out)
        self.running.append(seq_group)

    def _ignore_swapped(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        """vLLM's rule for a swapped group that needs more blocks than the whole cache: it
        can never run again, so it ends (FINISHED_IGNORED, finish_reason "length")."""
        logger.warning(
            "Failing the request %s because there's not enough kv cache blocks to run the "
            "entire sequence.",
            seq_group.request_id,
        )
        self.swapped.popleft()
        for seq in seq_group.get_seqs(status=SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.FINISHED_IGNORED
            self.block_manager.free(seq)
        out.ignored_seq_groups.append(seq_group)

    # -- preemption (both policies) --------------------------------------------------------

    def grow_or_preempt(
        self,
        seq_group: SequenceGroup,
        out: SchedulerOutputs,
        next_victim: Callable[[], SequenceGroup | None],
    ) -> bool:
        """Make room for the running group's next tokens by preempting lower-priority
        running groups (from `next_victim`) and append its slots; True if it runs, False if
        it had to be preempted itself because no victim was left. A preempted group leaves
        `running` for `waiting` (recompute) or `swapped`."""
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
            self.running.remove(seq_group)
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
            self.running.remove(seq_group)
            self.swapped.append(seq_group)
        # Resumed, it is sent to the stages in full (its table and tokens start over).
        StepWriter.forget(seq_group)
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

    # -- the KV block bound ----------------------------------------------------------------

    def kv_blocks_bound(self) -> int:
        """A bound on the device block ids the admitted requests can reach before the next
        admission: the blocks of every running sequence at its longest, plus the free blocks
        that still hold prefix-cache KV.

        The block manager hands out the lowest free block first (a cached block is reused
        only when no other is free), so a new block's id stays below the number of blocks in
        use or cached, which these cannot exceed. Blocks taken earlier may sit higher (taken
        when more were in use, then others were freed): the bound is at least the highest
        block handed out since the last reset. Workers use it to map and zero their cache
        ahead of the writes (CacheEngine.reserve), and zero a block only the first time it is
        inside the bound -- so a stage whose cache is new (a stage-local rebuild) must never
        see a bound below a block its kept requests hold, or a later step would zero that
        block's rebuilt KV."""
        return self._kv_blocks_bound

    def refresh_kv_blocks_bound(self) -> None:
        """Blocks were handed out outside a step (a stage-local rebuild's swap rounds): the
        bound follows before the next message carries it."""
        self._kv_blocks_bound = self._bound_running_blocks()

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
            total += seqs * ceil_div(longest, block_size)
        # Parked prefix-cache blocks keep their ids until they are evicted.
        total += self.block_manager.get_num_cached_free_blocks()
        total = max(total, self.block_manager.gpu_high_water())
        return min(total, self.block_manager.num_total_gpu_blocks)


def _attention_pairs(
    seq_group: SequenceGroup, chunk: int, offset: int, drafts: dict[str, dict[int, list[int]]]
) -> int:
    """Query-key pairs the attention of `seq_group`'s part of a step scores: its prompt chunk
    after the tokens computed or in flight, or one position (plus its drafts) per decoding
    sequence over its whole length."""
    seqs = seq_group.get_seqs(status=SequenceStatus.RUNNING)
    if seq_group.is_prefill():
        if len(seqs) == 1:
            return StepCost.chunk_pairs(seqs[0].data.get_num_computed_tokens() + offset, chunk)
        return sum(
            StepCost.chunk_pairs(s.data.get_num_computed_tokens(), s.get_num_new_tokens())
            for s in seqs
        )
    group_drafts = drafts.get(seq_group.request_id, {})
    return sum((1 + len(group_drafts.get(s.seq_id, ()))) * s.get_len() for s in seqs)
