"""The one replay driver: how a stage-local rebuild brings lost KV back, for every plan
(a replaced stage: `plans/local_rebuild.py`; a neighbour that took a lost stage's layers:
`plans/shrink.py`). Imports no torch.

A replay feeds each kept sequence's committed tokens [0, num_computed_tokens) as prefill
chunks, at most `max_num_batched_tokens` per step, in order (a later chunk reads the KV of the
earlier ones as its cached context). Only the stages being rebuilt run their layers; a kept
stage whose next stage is rebuilt sends its boundary rows. Nothing is sampled. Block
operations no rank applied yet go with the first step (`before`), those that end a round
with the last (`after`). A replay step is an ordinary step message (`vllm.step_records`): its
chunks are `NewRequestData` records and its `StepMessage.replay` (a `ReplayPlan`) names the
stages to rebuild and carries those block operations.

Also the work figures every plan reports alike: the tokens each sequence had KV for at the
failure (what recomputing it in full computes again) and what the requests recomputed in full
cost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceData, SequenceGroup, SequenceStage, SequenceStatus
from vllm.step_records import (
    BlockOps,
    ExecuteModelRequest,
    NewRequestData,
    NewSeqData,
    ReplayPlan,
    StepMessage,
)

if TYPE_CHECKING:
    from vllm.core.block_manager import BlockSpaceManager

# Nothing is sampled in a replay: the request's own parameters (a logits processor...) need
# not travel.
_NO_SAMPLING = SamplingParams()

# Runs one replay step on every rank within a deadline (s): the executor's `replay` or, for a
# merged stage, `replay_gained_layers`.
SendReplay = Callable[[ExecuteModelRequest, float], None]
# The deadline of a step of so many tokens (`ParallelConfig.step_deadline_s`).
StepDeadline = Callable[[int], float]

# One replay step's records: a prefill chunk of one sequence each (see `StepMessage`).
ReplayStep = list[NewRequestData]


def replay_steps(
    groups: list[SequenceGroup], block_manager: BlockSpaceManager, max_tokens: int
) -> list[ReplayStep]:
    """The chunks to replay, packed into steps of at most `max_tokens` tokens; a sequence
    has at most one chunk per step. Each running sequence replays its committed tokens.
    Forked samples sharing blocks each replay their own tokens (the shared blocks are
    written twice with the same rows)."""
    if max_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_tokens}.")
    steps: list[ReplayStep] = []
    current: ReplayStep = []
    room = max_tokens
    for group in groups:
        if group.is_finished():
            continue
        for seq in group.get_seqs(status=SequenceStatus.RUNNING):
            start, committed = 0, seq.data.get_num_computed_tokens()
            table = block_manager.get_block_table(seq)
            while start < committed:
                length = min(committed - start, room)
                current.append(_chunk(group, seq.seq_id, seq.data, table, start, length))
                start += length
                room -= length
                if room == 0:
                    steps.append(current)
                    current, room = [], max_tokens
    if current:
        steps.append(current)
    return steps


def _chunk(
    group: SequenceGroup,
    seq_id: int,
    data: SequenceData,
    table: list[int],
    start: int,
    length: int,
) -> NewRequestData:
    """Tokens [start, start + length) of one sequence as a prefill chunk with its cached
    context [0, start) (the stage's `prepare_inputs` reads it so)."""
    copy = SequenceData(
        list(data.prompt_token_ids), list(data.output_token_ids), data.cumulative_logprob,
        data.eos_token_id, start, SequenceStage.PREFILL, data.sample_index,
    )  # fmt: skip
    lora_int_id = group.lora_int_id
    return NewRequestData(
        request_id=f"{group.request_id}/replay-{seq_id}",
        is_prompt=True,
        token_chunk_size=length,
        do_sample=False,
        seqs=(NewSeqData(seq_id, copy, tuple(table)),),
        sampling_params=(_NO_SAMPLING, lora_int_id) if lora_int_id else _NO_SAMPLING,
    )


def replay_tokens(steps: list[ReplayStep]) -> int:
    """Tokens the replay steps feed."""
    return sum(step_tokens(step) for step in steps)


def step_tokens(step: ReplayStep) -> int:
    return sum(record.token_chunk_size for record in step)


def run_replay(
    send: SendReplay,
    deadline: StepDeadline,
    stages: list[int],
    steps: list[ReplayStep],
    kv_blocks_bound: int,
    before: list[BlockOps] | None = None,
    after: list[BlockOps] | None = None,
) -> int:
    """Send `steps` one at a time through `send`, rebuilding `stages` (PP ranks; none: only
    the block operations run), each within the deadline of a step of its tokens. `before`
    goes with the first step and `after` with the last; with block operations and no tokens
    one empty step carries them. Returns the tokens replayed; an error from a step is raised
    as is (the caller falls back to a full recompute)."""
    before, after = before or [], after or []
    if not steps and (before or after):
        steps = [[]]
    for index, step in enumerate(steps):
        plan = ReplayPlan(
            list(stages),
            before if index == 0 else [],
            after if index == len(steps) - 1 else [],
        )
        message = StepMessage(list(step), replay=plan)
        send(
            ExecuteModelRequest(message, kv_blocks_bound=kv_blocks_bound),
            deadline(step_tokens(step)),
        )
    return replay_tokens(steps)


def committed_tokens(groups: Iterable[SequenceGroup]) -> dict[int, int]:
    """Per unfinished sequence of `groups`: the tokens whose KV it has (its committed
    computed tokens; a step's output advances them only once it is collected)."""
    return {
        seq.seq_id: seq.data.get_num_computed_tokens()
        for g in groups
        for seq in g.get_unfinished_seqs()
    }


def tokens_in_full(groups: Iterable[SequenceGroup], committed_at_fault: dict[int, int]) -> int:
    """What recomputing `groups` in full computes again: the tokens each of their sequences
    had KV for at the failure (a prompt that was in flight had none: it runs again on any
    path, fault or not)."""
    return sum(
        committed_at_fault.get(seq.seq_id, 0) for g in groups for seq in g.get_unfinished_seqs()
    )
