"""The scheduler's pen: one step record per scheduled group, written from what the stages hold.

What the first and last stages hold lives on the request, not in a mirror: a group's
`held_generation` (the stages were sent it in full in this generation) and each sequence's
`held` (`HeldBySequence`: tokens and leading block-table entries they hold, and the table epoch
those entries belong to). `write` reads these facts and writes a `NewRequestData` or a
`CachedRequestData`; the facts themselves change only in `commit`, once the executor accepted
the step -- a step that is never sent leaves them as they were, so the next step says the same
again. `forget_all` (an interrupt or a stage failure emptied the pipeline) starts a new
generation: every request is sent in full again and the next step tells the stages to forget
what they hold. Imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from vllm.sequence import HeldBySequence, SequenceGroup, SequenceStatus
from vllm.step_records import (
    CachedRequestData,
    CachedSeqData,
    NewRequestData,
    NewSeqData,
    RequestRecord,
)

if TYPE_CHECKING:
    from vllm.core.block_manager import BlockSpaceManager
    from vllm.sequence import Sequence


class _Held(NamedTuple):
    """A sequence's `held` as it will be once the step is accepted."""

    seq: Sequence
    held: HeldBySequence


class StepRecords(NamedTuple):
    """One step as written: the records in schedule order, and what `commit` makes true."""

    records: list[RequestRecord]
    # The stages must forget every request before this step (a new generation began).
    reset: bool
    groups: list[SequenceGroup]
    seqs: list[_Held]


class StepWriter:
    """Writes the records of a step (owned by the scheduler; see the module docstring)."""

    def __init__(self, block_manager: BlockSpaceManager) -> None:
        self.block_manager = block_manager
        # The stages' generation: requests held under another one are sent in full again.
        self.generation = 0
        self._reset_pending = False

    def write(
        self,
        groups: list[SequenceGroup],
        token_chunk_sizes: dict[str, int],
        ahead: dict[str, int],
        chunk_offsets: dict[str, int] | None = None,
        drafts: dict[str, dict[int, list[int]]] | None = None,
    ) -> StepRecords:
        """The records of the scheduled `groups`; the sequences of a group in `ahead` feed
        the token their step in flight samples (`num_pending=1`); a prefill chunk of a group
        in `chunk_offsets` starts that many tokens after its computed ones (its earlier
        chunks are still in flight: chunked pipelining); the sequences of a group in `drafts`
        verify those draft tokens (a speculative decode)."""
        offsets = chunk_offsets or {}
        step = StepRecords([], self._reset_pending, [], [])
        for group in groups:
            offset = offsets.get(group.request_id, 0)
            record = self._write_group(group, token_chunk_sizes, ahead, offset, step)
            planned = drafts.get(group.request_id) if drafts else None
            if planned:
                record = record._replace(
                    drafts=tuple((seq_id, tuple(ids)) for seq_id, ids in planned.items())
                )
            step.records.append(record)
            step.groups.append(group)
        return step

    def _write_group(
        self,
        group: SequenceGroup,
        token_chunk_sizes: dict[str, int],
        ahead: dict[str, int],
        offset: int,
        step: StepRecords,
    ) -> RequestRecord:
        seqs = group.get_seqs(status=SequenceStatus.RUNNING)
        is_prompt = group.is_prefill()
        chunk = token_chunk_sizes[group.request_id] if is_prompt else 1
        do_sample = True
        if is_prompt:
            data = seqs[0].data
            # A chunk that stops before the end of the prompt samples nothing.
            do_sample = data.get_num_computed_tokens() + offset + chunk >= data.get_len()
        held = group.held_generation == self.generation
        if offset and (not held or len(seqs) != 1):
            raise RuntimeError(
                f"request {group.request_id}: a chunk scheduled behind chunks in flight must "
                "be of one sequence the stages hold"
            )
        num_pending = 1 if group.request_id in ahead else 0
        records = tuple(self._write_seq(seq, held, num_pending, offset, step) for seq in seqs)
        if held:
            return CachedRequestData(group.request_id, is_prompt, chunk, do_sample, records)
        if num_pending:
            raise RuntimeError(
                f"request {group.request_id}: scheduled ahead before the stages ever held it"
            )
        params = group.sampling_params
        lora_int_id = group.lora_int_id
        return NewRequestData(
            group.request_id,
            is_prompt,
            chunk,
            do_sample,
            records,  # type: ignore[arg-type]  # all NewSeqData: the group is not held
            (params, lora_int_id) if lora_int_id else params,
            group.pooling_params,
        )

    def _write_seq(
        self, seq: Sequence, group_held: bool, num_pending: int, offset: int, step: StepRecords
    ) -> NewSeqData | CachedSeqData:
        bm = self.block_manager
        table = bm.get_block_table(seq)
        epoch = bm.table_epoch(seq)
        data = seq.data
        length = data.get_len()
        held = seq.held if group_held else None
        record: NewSeqData | CachedSeqData
        if held is None:
            record = NewSeqData(seq.seq_id, data, tuple(table))
            num_tokens = length
        else:
            new_tokens: tuple[int, ...] = ()
            if length > held.num_tokens:
                new_tokens = tuple(data.output_token_ids[held.num_tokens - data.get_prompt_len() :])
            whole = held.table_epoch != epoch or len(table) < held.num_blocks
            num_tokens = max(length, held.num_tokens) + num_pending
            record = CachedSeqData(
                seq.seq_id, new_tokens, num_pending, data.get_num_computed_tokens() + offset,
                data.cumulative_logprob, tuple(table if whole else table[held.num_blocks :]),
                whole, num_tokens,
            )  # fmt: skip
        step.seqs.append(_Held(seq, HeldBySequence(num_tokens, len(table), epoch)))
        return record

    def commit(self, step: StepRecords) -> None:
        """The executor accepted `step`: the stages now hold what it told them."""
        for group in step.groups:
            group.held_generation = self.generation
        for seq, held in step.seqs:
            seq.held = held
        if step.reset:
            self._reset_pending = False

    def forget_all(self) -> None:
        """The stages forget every request (the next step says so): a new generation."""
        self.generation += 1
        self._reset_pending = True

    @staticmethod
    def forget(group: SequenceGroup) -> None:
        """The stages no longer hold this group's state (it was preempted): sent in full
        when it runs again."""
        group.held_generation = -1
