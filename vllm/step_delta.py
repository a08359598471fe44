"""Step messages as deltas: what the first and last stages are told at each step.

The first stage (which builds input ids) and the last stage (which samples) keep each request's
state across steps: token ids, sampling params, block tables. The engine tells them a request
once, in full, and afterwards only what changed: new token ids, new blocks, the computed count.
`StepEncoder` (engine side) remembers what the stages hold; `StageRequestState` (stage side)
holds it and turns each message back into the `SequenceGroupMetadata` the model runner reads.

A decode scheduled ahead of its previous step's output (the asynchronous pipeline) feeds a
token the engine has not seen yet: the seq's delta says `num_pending=1` and the stage appends
the token it sampled itself (last stage) or received from the last stage (first stage); see
`StageRequestState.record_sampled`.

Every delta carries the sequence's expected length, and the stage checks it: a mirror out of
step fails loudly at once, naming the request, instead of feeding the wrong tokens.

Imports no torch: the engine side and these tests run without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from vllm.sequence import SequenceData, SequenceGroupMetadata

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams


class SeqDelta(NamedTuple):
    """One sequence's change since the stage last saw it (a NamedTuple pickles compactly)."""

    seq_id: int
    # The whole SequenceData when the stage does not hold this sequence yet, else None.
    data: SequenceData | None
    # Output token ids the engine appended since the last message (empty when `data` is set).
    new_token_ids: tuple[int, ...]
    # Tokens the stage appends from its own record of sampled ids (asynchronous decode).
    num_pending: int
    num_computed_tokens: int
    cumulative_logprob: float
    # Block table = the held table's first `blocks_from` entries + `blocks`.
    blocks_from: int
    blocks: tuple[int, ...]
    # The sequence's length once the delta is applied (a consistency check).
    length: int


class GroupDelta(NamedTuple):
    """One scheduled group: its step fields plus the deltas of its running sequences."""

    request_id: str
    is_prompt: bool
    token_chunk_size: int
    do_sample: bool
    seqs: tuple[SeqDelta, ...]
    # Sent with the request's first message only (None afterwards); for a request with a
    # LoRA adapter, (params, lora_int_id): a request without one pays no byte for LoRA.
    sampling_params: SamplingParams | tuple[SamplingParams, int] | None


@dataclass
class StepMessage:
    """A step for the first and last stages.

    `step_no` numbers the steps the engine submitted; with `send_sampled` the last stage sends
    the ids it sampled at this step to the first stage, which receives every such message up
    to `recv_sampled_through` before it builds this step's inputs. `reset` tells the stage to
    forget every request first (the engine's mirror was reset after an interrupt or failure).
    """

    groups: list[GroupDelta] = field(default_factory=list)
    step_no: int = 0
    send_sampled: bool = False
    recv_sampled_through: int = 0
    reset: bool = False


@dataclass
class _Sent:
    """What the stages hold of one request (the engine's mirror)."""

    params: SamplingParams | None = None
    # seq_id -> (tokens held, block table held)
    seqs: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


class EncoderCheckpoint(NamedTuple):
    """The mirror's entries of one step's requests before it was encoded (None: not held)."""

    held: dict[str, _Sent | None]
    reset_pending: bool


class StepEncoder:
    """Engine side: turns a step's metadata into deltas against what the stages hold."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._reset_pending = False

    def encode(
        self,
        metadata_list: list[SequenceGroupMetadata],
        pending: dict[int, int] | None = None,
    ) -> StepMessage:
        """Deltas of `metadata_list`; `pending[seq_id]` counts tokens the stages take from
        their own sampled ids (decodes scheduled before their previous output came back)."""
        pending = pending or {}
        groups = [self._encode_group(meta, pending) for meta in metadata_list]
        message = StepMessage(groups, reset=self._reset_pending)
        self._reset_pending = False
        return message

    def _encode_group(self, meta: SequenceGroupMetadata, pending: dict[int, int]) -> GroupDelta:
        sent = self._sent.get(meta.request_id)
        new_request = sent is None
        if sent is None:
            sent = self._sent[meta.request_id] = _Sent(meta.sampling_params)
        held_seqs: dict[int, tuple[int, list[int]]] = {}
        deltas = []
        for seq_id, data in meta.seq_data.items():
            table = meta.block_tables[seq_id]
            num_pending = pending.get(seq_id, 0)
            held = sent.seqs.get(seq_id)
            if held is None:
                if num_pending:
                    raise RuntimeError(
                        f"request {meta.request_id}: sequence {seq_id} is scheduled ahead "
                        "before the stages ever held it"
                    )
                delta = SeqDelta(
                    seq_id, data, (), 0, data.get_num_computed_tokens(),
                    data.cumulative_logprob, 0, tuple(table), data.get_len(),
                )  # fmt: skip
            else:
                num_held, held_table = held
                length = data.get_len()
                new_tokens: tuple[int, ...] = ()
                if length > num_held:
                    new_tokens = tuple(data.output_token_ids[num_held - data.get_prompt_len() :])
                kept = len(held_table)
                if len(table) < kept or table[:kept] != held_table:
                    kept = 0  # not an append (copy-on-write, swap, recompute): send it all
                delta = SeqDelta(
                    seq_id, None, new_tokens, num_pending, data.get_num_computed_tokens(),
                    data.cumulative_logprob, kept, tuple(table[kept:]),
                    max(length, num_held) + num_pending,
                )  # fmt: skip
            deltas.append(delta)
            held_seqs[seq_id] = (delta.length, list(table))
        # A group's message lists all its running sequences: the ones missing are gone.
        sent.seqs = held_seqs
        changed = new_request or sent.params is not meta.sampling_params
        params = meta.sampling_params if changed else None
        sent.params = meta.sampling_params
        return GroupDelta(
            meta.request_id,
            meta.is_prompt,
            meta.token_chunk_size if meta.token_chunk_size is not None else 1,
            meta.do_sample,
            tuple(deltas),
            (params, meta.lora_int_id) if params is not None and meta.lora_int_id else params,
        )

    def checkpoint(self, request_ids: list[str]) -> EncoderCheckpoint:
        """What the mirror holds of these requests now, for `rollback` if the step encoded
        next is never sent."""
        held = {}
        for request_id in request_ids:
            sent = self._sent.get(request_id)
            held[request_id] = None if sent is None else _Sent(sent.params, dict(sent.seqs))
        return EncoderCheckpoint(held, self._reset_pending)

    def rollback(self, checkpoint: EncoderCheckpoint) -> None:
        """The step encoded since `checkpoint` was not sent: the stages hold what they held."""
        for request_id, sent in checkpoint.held.items():
            if sent is None:
                self._sent.pop(request_id, None)
            else:
                self._sent[request_id] = sent
        self._reset_pending = checkpoint.reset_pending

    def forget(self, request_ids: list[str]) -> None:
        """These requests finished: the stages drop them too (`finished_request_ids`)."""
        for request_id in request_ids:
            self._sent.pop(request_id, None)

    def reset(self) -> None:
        """Forget everything; the next message tells the stages to do the same."""
        self._sent.clear()
        self._reset_pending = True

    def num_requests(self) -> int:
        return len(self._sent)


@dataclass
class _Held:
    params: SamplingParams
    seqs: dict[int, SequenceData]
    tables: dict[int, list[int]]
    lora_int_id: int = 0


class StageRequestState:
    """Stage side: the requests this stage holds, updated by each StepMessage."""

    def __init__(self) -> None:
        self._requests: dict[str, _Held] = {}
        # seq_id -> the last token id sampled for it (from this stage's sampler, or received
        # from the last stage); read by deltas with num_pending.
        self._sampled: dict[int, int] = {}
        self._owner: dict[int, str] = {}

    def apply(self, message: StepMessage) -> list[SequenceGroupMetadata]:
        """Update the held requests with `message`; return the step's group metadata."""
        if message.reset:
            self.clear()
        return [self._apply_group(group) for group in message.groups]

    def _apply_group(self, group: GroupDelta) -> SequenceGroupMetadata:
        held = self._requests.get(group.request_id)
        params, lora_int_id = group.sampling_params, 0
        if isinstance(params, tuple):
            params, lora_int_id = params
        if held is None:
            if params is None:
                raise RuntimeError(
                    f"request {group.request_id}: the stage does not hold it and the step "
                    "did not send its sampling params"
                )
            held = self._requests[group.request_id] = _Held(params, {}, {}, lora_int_id)
        elif params is not None:
            held.params, held.lora_int_id = params, lora_int_id
        seqs: dict[int, SequenceData] = {}
        tables: dict[int, list[int]] = {}
        for delta in group.seqs:
            data = self._apply_seq(group.request_id, held, delta)
            seqs[delta.seq_id] = data
            old_table = held.tables.get(delta.seq_id, [])
            tables[delta.seq_id] = old_table[: delta.blocks_from] + list(delta.blocks)
            self._owner[delta.seq_id] = group.request_id
        for seq_id in held.seqs.keys() - seqs.keys():
            self._forget_seq(seq_id)
        held.seqs, held.tables = seqs, tables
        return SequenceGroupMetadata(
            request_id=group.request_id,
            is_prompt=group.is_prompt,
            seq_data=seqs,
            sampling_params=held.params,
            block_tables=tables,
            token_chunk_size=group.token_chunk_size,
            do_sample=group.do_sample,
            lora_int_id=held.lora_int_id,
        )

    def _apply_seq(self, request_id: str, held: _Held, delta: SeqDelta) -> SequenceData:
        if delta.data is not None:
            src = delta.data
            # A copy: in-process the engine's own object arrives here, and this stage
            # appends tokens to its data independently of the engine.
            data = SequenceData(
                list(src.prompt_token_ids), list(src.output_token_ids), src.cumulative_logprob,
                src.eos_token_id, src.get_num_computed_tokens(), src.stage, src.sample_index,
            )  # fmt: skip
        else:
            data = held.seqs.get(delta.seq_id)  # type: ignore[assignment]
            if data is None:
                raise RuntimeError(
                    f"request {request_id}: the stage does not hold sequence {delta.seq_id}"
                )
            data.output_token_ids.extend(delta.new_token_ids)
            for _ in range(delta.num_pending):
                token = self._sampled.get(delta.seq_id)
                if token is None:
                    raise RuntimeError(
                        f"request {request_id}: sequence {delta.seq_id} was scheduled ahead "
                        "but this stage has no sampled token for it"
                    )
                data.output_token_ids.append(token)
            data._num_computed_tokens = delta.num_computed_tokens
            data.cumulative_logprob = delta.cumulative_logprob
        if data.get_len() != delta.length:
            raise RuntimeError(
                f"request {request_id}: sequence {delta.seq_id} has {data.get_len()} tokens on "
                f"this stage but the engine expects {delta.length} (step messages out of sync)"
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
        """Finished or aborted requests: forget them."""
        for request_id in request_ids:
            held = self._requests.pop(request_id, None)
            if held is not None:
                for seq_id in held.seqs:
                    self._forget_seq(seq_id)

    def clear(self) -> None:
        self._requests.clear()
        self._sampled.clear()
        self._owner.clear()

    def num_requests(self) -> int:
        return len(self._requests)


@dataclass
class ExecuteModelRequest:
    """One step for one stage worker: the batch as deltas (first and last stages only; middle
    stages get their inputs from the previous stage) and the cache operations every stage
    applies."""

    step: StepMessage | None
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    # Requests finished since the last step: the last stage drops their seeded generators.
    finished_request_ids: list[str] = field(default_factory=list)
    # Scheduler.kv_blocks_bound(): how far into its cache a stage should have memory mapped.
    kv_blocks_bound: int = 0
