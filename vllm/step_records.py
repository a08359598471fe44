"""The step records the scheduler writes once, and the message that carries them to the stages.

The first stage (which builds input ids) and the last stage (which samples) keep each request
across steps. Per scheduled group the scheduler writes (`vllm.core.step_writer`) one record, as
vLLM V1's `SchedulerOutput` does:
- `NewRequestData`: the stages do not hold the request (its first schedule, resumed after a
  preemption, or after the stages forgot every request): its sequences in full, its block
  tables and its sampling params (sent only here).
- `CachedRequestData`: only what changed since the stages last saw it: new token ids, new
  block ids appended to the table (or the whole table when the block manager rewrote an
  entry: copy-on-write, swap), the computed-token count. A sequence the stages do not hold
  yet (a fork) travels in full inside it (`NewSeqData`).

A decode scheduled ahead of its previous step's output (the asynchronous pipeline) feeds a
token the engine has not seen yet: its `CachedSeqData` says `num_pending=1` and the stage
appends the token it sampled itself (last stage) or received from the last stage (first
stage). Every cached sequence carries its expected length, which the stage checks: a stage out
of step fails loudly at once, naming the request, instead of feeding the wrong tokens.

A replay step of a stage-local rebuild is the same message with a `ReplayPlan` (the stages to
rebuild, the block operations around it): one wire format for steps and replays.

Records are NamedTuples (they pickle compactly). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from vllm.sequence import SequenceData

if TYPE_CHECKING:
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams


# The draft tokens a speculative step verifies: (seq id, drafts) per sequence. The drafts are
# never appended to the stage's copy of the sequence: only the accepted ones come back as
# tokens in a later record.
Drafts = tuple[tuple[int, tuple[int, ...]], ...]


class NewSeqData(NamedTuple):
    """A sequence the stages do not hold: all its tokens and its block table."""

    seq_id: int
    data: SequenceData
    block_ids: tuple[int, ...]


class CachedSeqData(NamedTuple):
    """A sequence the stages hold: what changed since they last saw it."""

    seq_id: int
    # Output token ids the engine appended since the stages last saw the sequence.
    new_token_ids: tuple[int, ...]
    # Tokens the stage appends from its own record of sampled ids (asynchronous decode).
    num_pending: int
    num_computed_tokens: int
    cumulative_logprob: float
    # Appended to the held block table; with `whole_table`, the table itself.
    new_block_ids: tuple[int, ...]
    whole_table: bool
    # The sequence's length once the record is applied (a consistency check).
    length: int


class NewRequestData(NamedTuple):
    """A scheduled group the stages do not hold, sent in full."""

    request_id: str
    is_prompt: bool
    token_chunk_size: int
    do_sample: bool
    seqs: tuple[NewSeqData, ...]
    # For a request with a LoRA adapter, (params, lora_int_id): a request without one pays
    # no byte for LoRA.
    sampling_params: SamplingParams | tuple[SamplingParams, int]
    # A pooling request's parameters (the last stage pools instead of sampling).
    pooling_params: PoolingParams | None = None
    # A speculative decode: (seq id, draft token ids) per sequence that verifies drafts.
    drafts: Drafts | None = None


class CachedRequestData(NamedTuple):
    """A scheduled group the stages hold: its step fields and its running sequences (the
    stage forgets the held sequences not listed: they finished)."""

    request_id: str
    is_prompt: bool
    token_chunk_size: int
    do_sample: bool
    seqs: tuple[NewSeqData | CachedSeqData, ...]
    # A speculative decode: (seq id, draft token ids) per sequence that verifies drafts.
    drafts: Drafts | None = None


# One record per scheduled group, in the scheduler's order (outputs are matched positionally).
RequestRecord = NewRequestData | CachedRequestData


@dataclass
class StepMessage:
    """A step for the first and last stages.

    `step_no` numbers the steps the engine submitted; with `send_sampled` the last stage sends
    the ids it sampled at this step to the first stage, which receives every such message up
    to `recv_sampled_through` before it builds this step's inputs. `reset` tells the stage to
    forget every request first (the scheduler's stage generation moved on after an interrupt
    or failure: every request is sent in full again).

    A replay step of a stage-local KV rebuild (`replay` set; `vllm.resilience.replay`) is the
    same message, sent to every rank through a replay verb: each group is a `NewRequestData`
    prefill chunk of one sequence's committed tokens (`num_computed_tokens` is the chunk's
    start, `token_chunk_size` its length, nothing sampled). A stage reads its rows without
    its request table, which a replay neither reads nor changes (the first step after a
    recovery resets it anyway).
    """

    groups: list[RequestRecord] = field(default_factory=list)
    step_no: int = 0
    send_sampled: bool = False
    recv_sampled_through: int = 0
    reset: bool = False
    replay: ReplayPlan | None = None


@dataclass
class ExecuteModelRequest:
    """One step for one stage worker: the batch's records (first and last stages only; middle
    stages get their inputs from the previous stage) and the cache operations every stage
    applies."""

    step: StepMessage | None
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    # Requests finished since the last step: the stages drop them (and their generators).
    finished_request_ids: list[str] = field(default_factory=list)
    # Scheduler.kv_blocks_bound(): how far into its cache a stage should have memory mapped.
    kv_blocks_bound: int = 0

    def block_ops(self) -> BlockOps:
        return BlockOps(self.blocks_to_swap_in, self.blocks_to_swap_out, self.blocks_to_copy)

    def replay_plan(self, verb: str) -> ReplayPlan:
        """The plan of a replay step sent to `verb`. ValueError naming what is wrong when this
        is not a well-formed one: an ordinary step (no `StepMessage.replay`), a record the
        stage would have to look up in its request table (a replay sends every chunk in
        full), or block operations or finished requests of the request's own (the plan's
        `before`/`after` lists say where block operations go in a replay)."""
        step = self.step
        if step is None or step.replay is None:
            raise ValueError(f"{verb}: not a replay step (StepMessage.replay is None)")
        if self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_copy:
            raise ValueError(
                f"{verb}: a replay step's block operations go in its plan (ReplayPlan.before "
                "/ after), not in the request"
            )
        if self.finished_request_ids:
            raise ValueError(f"{verb}: a replay step finishes no request")
        if step.reset or step.send_sampled:
            raise ValueError(f"{verb}: a replay step neither resets the stages nor samples")
        for record in step.groups:
            if not isinstance(record, NewRequestData) or not record.is_prompt or record.do_sample:
                raise ValueError(
                    f"{verb}: request {record.request_id}: a replay step's records are "
                    "NewRequestData prefill chunks that sample nothing"
                )
        return step.replay


@dataclass
class ReplayPlan:
    """What makes a step a replay step (`StepMessage.replay`).

    A stage in `rebuild_stages` (PP ranks, ascending) runs its layers on the step's chunks; a
    kept stage whose next stage is rebuilt sends its boundary rows for those slots. Every rank
    applies the block operations `before` in order first (those of steps whose submission
    failed; swapped groups brought back with the replay) and `after` once its part is done (a
    round that rebuilds swapped groups swaps them out again: `vllm.core.stage_rollback`). The
    step's own `ExecuteModelRequest` block operations stay empty: one list, one order."""

    rebuild_stages: list[int]
    before: list[BlockOps] = field(default_factory=list)
    after: list[BlockOps] = field(default_factory=list)


@dataclass
class BlockOps:
    """One step's block operations, applied by a stage in this order before its forward."""

    swap_in: dict[int, int] = field(default_factory=dict)  # cpu block -> gpu block
    swap_out: dict[int, int] = field(default_factory=dict)  # gpu block -> cpu block
    copy: dict[int, list[int]] = field(default_factory=dict)  # src gpu block -> dst blocks
