"""The requests a first or last stage holds, kept up to date by each step's records.

`RequestTable.apply` takes a `StepMessage` (records written once by the scheduler, see
`vllm.step_records`) and hands the model runner the step's rows: one `SequenceGroupMetadata` per
scheduled group, and the order they take in the flat token batch (prefills first, then decodes),
derived here once. The table also owns the per-request seeded generators of the last stage and
the ids each sequence sampled last (for decodes scheduled ahead). A replay step's rows
(`replay_rows`) are read without the table, which they leave as it was: every chunk is a group
sent in full (`new_request_metadata`, the table's own unpacking). Imports no torch (the
generators are created by the sampling code), so the engine's fake pipelines use it as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.sequence import SequenceData, SequenceGroupMetadata, SequenceStage
from vllm.step_records import (
    CachedSeqData,
    Drafts,
    NewRequestData,
    NewSeqData,
    RequestRecord,
    StepMessage,
)

if TYPE_CHECKING:
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams


@dataclass
class StepRows:
    """One step's groups for the model runner.

    `groups` is the scheduler's order (one output per group, matched positionally); `layout`
    the same groups in the flat token batch's order: prefills first, then decodes; `order[i]`
    is the position in `layout` of `groups[i]`."""

    groups: list[SequenceGroupMetadata]
    layout: list[SequenceGroupMetadata] = field(default_factory=list)
    order: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, groups: list[SequenceGroupMetadata]) -> StepRows:
        """Rows of `groups` (scheduler order), with the prefills-first layout derived:
        prompts, then speculative decodes (each sequence feeds its last token and drafts as
        several decode rows), then plain decodes."""
        prefills = [i for i, meta in enumerate(groups) if meta.is_prompt]
        verifies = [i for i, m in enumerate(groups) if not m.is_prompt and m.draft_token_ids]
        decodes = [i for i, m in enumerate(groups) if not m.is_prompt and not m.draft_token_ids]
        positions = prefills + verifies + decodes
        order = [0] * len(groups)
        for position, index in enumerate(positions):
            order[index] = position
        return cls(groups, [groups[i] for i in positions], order)


@dataclass
class _Held:
    params: SamplingParams
    seqs: dict[int, SequenceData]
    tables: dict[int, list[int]]
    lora_int_id: int = 0
    pooling_params: PoolingParams | None = None


class RequestTable:
    """The held requests of one stage (first or last), their sampled ids and generators."""

    def __init__(self) -> None:
        self._requests: dict[str, _Held] = {}
        # seq_id -> the last token id sampled for it (from this stage's sampler, or received
        # from the last stage); read by records with num_pending.
        self._sampled: dict[int, int] = {}
        self._owner: dict[int, str] = {}
        # request id -> its seeded torch.Generator (last stage; see build_sampling_metadata).
        self.generators: dict[str, Any] = {}

    def apply(self, message: StepMessage) -> StepRows:
        """Update the held requests with `message`; return the step's rows."""
        if message.reset:
            self.clear()
        return StepRows.of([self._apply_group(record) for record in message.groups])

    def _apply_group(self, record: RequestRecord) -> SequenceGroupMetadata:
        request_id = record.request_id
        if isinstance(record, NewRequestData):
            meta = new_request_metadata(record)
            # Whatever the stage held of this request is stale (it was preempted, or the
            # stages forgot it): the record replaces it.
            self.drop([request_id])
            self._requests[request_id] = _Held(
                meta.sampling_params, meta.seq_data, meta.block_tables, meta.lora_int_id,
                meta.pooling_params,
            )  # fmt: skip
            for seq_id in meta.seq_data:
                self._owner[seq_id] = request_id
            return meta
        held = self._requests.get(request_id)
        if held is None:
            raise RuntimeError(
                f"request {request_id}: the stage does not hold it and the step did not "
                "send it in full"
            )
        seqs: dict[int, SequenceData] = {}
        tables: dict[int, list[int]] = {}
        for seq in record.seqs:
            if isinstance(seq, NewSeqData):
                seqs[seq.seq_id] = _copy(seq.data)
                tables[seq.seq_id] = list(seq.block_ids)
            else:
                seqs[seq.seq_id] = self._apply_seq(request_id, held, seq, record.is_prompt)
                table = tables[seq.seq_id] = held.tables.get(seq.seq_id, [])
                if seq.whole_table:
                    table[:] = seq.new_block_ids
                else:
                    table.extend(seq.new_block_ids)
            self._owner[seq.seq_id] = request_id
        for seq_id in held.seqs.keys() - seqs.keys():
            self._forget_seq(seq_id)
        held.seqs, held.tables = seqs, tables
        return SequenceGroupMetadata(
            request_id=request_id,
            is_prompt=record.is_prompt,
            seq_data=seqs,
            sampling_params=held.params,
            block_tables=tables,
            token_chunk_size=record.token_chunk_size,
            do_sample=record.do_sample,
            lora_int_id=held.lora_int_id,
            pooling_params=held.pooling_params,
            draft_token_ids=_drafts(record.drafts),
        )

    def _apply_seq(
        self, request_id: str, held: _Held, seq: CachedSeqData, is_prompt: bool
    ) -> SequenceData:
        data = held.seqs.get(seq.seq_id)
        if data is None:
            raise RuntimeError(
                f"request {request_id}: the stage does not hold sequence {seq.seq_id}"
            )
        data.output_token_ids.extend(seq.new_token_ids)
        for _ in range(seq.num_pending):
            token = self._sampled.get(seq.seq_id)
            if token is None:
                raise RuntimeError(
                    f"request {request_id}: sequence {seq.seq_id} was scheduled ahead but this "
                    "stage has no sampled token for it"
                )
            data.output_token_ids.append(token)
        data._num_computed_tokens = seq.num_computed_tokens
        data._stage = SequenceStage.PREFILL if is_prompt else SequenceStage.DECODE
        data.cumulative_logprob = seq.cumulative_logprob
        if data.get_len() != seq.length:
            raise RuntimeError(
                f"request {request_id}: sequence {seq.seq_id} has {data.get_len()} tokens on "
                f"this stage but the engine expects {seq.length} (step records out of sync)"
            )
        return data

    def record_sampled(self, pairs: list[tuple[int, int]]) -> None:
        """(seq_id, token id) sampled at a step, for the decodes scheduled ahead of it."""
        for seq_id, token in pairs:
            if seq_id in self._owner:
                self._sampled[seq_id] = token

    def _forget_seq(self, seq_id: int) -> None:
        self._owner.pop(seq_id, None)
        self._sampled.pop(seq_id, None)

    def drop(self, request_ids: list[str]) -> None:
        """Finished or aborted requests: forget them and their generators."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)
            held = self._requests.pop(request_id, None)
            if held is not None:
                for seq_id in held.seqs:
                    self._forget_seq(seq_id)

    def clear(self) -> None:
        """Forget every request (the generators too: each draw re-seeds them anyway)."""
        self._requests.clear()
        self._sampled.clear()
        self._owner.clear()
        self.generators.clear()

    def request_ids(self) -> list[str]:
        """The ids of the requests this stage holds."""
        return list(self._requests)

    def num_requests(self) -> int:
        """How many requests this stage holds."""
        return len(self._requests)


def new_request_metadata(record: NewRequestData) -> SequenceGroupMetadata:
    """A group sent in full, as the model runner reads it: the stage's own copies of its
    sequences and tables. Stateless: `RequestTable` holds what it returns; a replay step
    (`replay_rows`) only runs it."""
    params, lora_int_id = record.sampling_params, 0
    if isinstance(params, tuple):
        params, lora_int_id = params
    return SequenceGroupMetadata(
        request_id=record.request_id,
        is_prompt=record.is_prompt,
        seq_data={seq.seq_id: _copy(seq.data) for seq in record.seqs},
        sampling_params=params,
        block_tables={seq.seq_id: list(seq.block_ids) for seq in record.seqs},
        token_chunk_size=record.token_chunk_size,
        do_sample=record.do_sample,
        lora_int_id=lora_int_id,
        pooling_params=record.pooling_params,
        draft_token_ids=_drafts(record.drafts),
    )


def replay_rows(message: StepMessage) -> StepRows:
    """The rows of a replay step (`StepMessage.replay`; its records checked by
    `ExecuteModelRequest.replay_plan`): every chunk was sent in full, so no request table is
    read or changed."""
    groups = []
    for record in message.groups:
        if not isinstance(record, NewRequestData):
            raise ValueError(
                f"request {record.request_id}: a replay step sends every chunk in full "
                "(NewRequestData)"
            )
        groups.append(new_request_metadata(record))
    return StepRows.of(groups)


def _drafts(drafts: Drafts | None) -> dict[int, list[int]] | None:
    return {seq_id: list(ids) for seq_id, ids in drafts} if drafts else None


def _copy(src: SequenceData) -> SequenceData:
    """The stage's own copy: in-process the engine's object arrives here, and the stage
    appends tokens to its copy independently of the engine."""
    return SequenceData(
        list(src.prompt_token_ids), list(src.output_token_ids), src.cumulative_logprob,
        src.eos_token_id, src.get_num_computed_tokens(), src.stage, src.sample_index,
        src.token_type_ids,
    )  # fmt: skip
