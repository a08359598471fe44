"""The replay steps of a stage-local KV rebuild: each kept sequence's committed tokens
[0, num_computed_tokens) as prefill chunks, at most `max_num_batched_tokens` per step, in
order (a later chunk reads the KV of the earlier ones as its cached context). Imports no
torch."""

from __future__ import annotations

from vllm.core.block_manager import BlockSpaceManager
from vllm.sampling_params import SamplingParams
from vllm.sequence import (
    SequenceData,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceStage,
    SequenceStatus,
)

# Nothing is sampled in a replay: the request's own parameters (a logits processor...) need
# not travel.
_NO_SAMPLING = SamplingParams()


def replay_steps(
    groups: list[SequenceGroup], block_manager: BlockSpaceManager, max_tokens: int
) -> list[list[SequenceGroupMetadata]]:
    """The chunks to replay, packed into steps of at most `max_tokens` tokens; a sequence
    has at most one chunk per step. Each running sequence replays its committed tokens.
    Forked samples sharing blocks each replay their own tokens (the shared blocks are
    written twice with the same rows)."""
    if max_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_tokens}.")
    steps: list[list[SequenceGroupMetadata]] = []
    current: list[SequenceGroupMetadata] = []
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
) -> SequenceGroupMetadata:
    """Tokens [start, start + length) of one sequence as a prefill chunk with its cached
    context [0, start) (the stage's `prepare_inputs` reads it so)."""
    copy = SequenceData(
        list(data.prompt_token_ids), list(data.output_token_ids), data.cumulative_logprob,
        data.eos_token_id, start, SequenceStage.PREFILL, data.sample_index,
    )  # fmt: skip
    return SequenceGroupMetadata(
        request_id=f"{group.request_id}/replay-{seq_id}",
        is_prompt=True,
        seq_data={seq_id: copy},
        sampling_params=_NO_SAMPLING,
        block_tables={seq_id: table},
        token_chunk_size=length,
        do_sample=False,
        lora_int_id=group.lora_int_id,
    )


def replay_tokens(steps: list[list[SequenceGroupMetadata]]) -> int:
    """Tokens the replay steps feed."""
    return sum(meta.token_chunk_size or 0 for step in steps for meta in step)
