"""What the last stage needs to sample: which hidden rows to turn into logits and, per row,
the group, sequence and sampling parameters (built from the scheduler's metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.sampling_params import SamplingParams, SamplingType
from vllm.sequence import SequenceData, SequenceGroupMetadata


@dataclass
class SeqGroupRows:
    """The logits rows of one scheduled group: one per running sequence (one for a prompt;
    none for a prefill chunk that does not end the prompt), plus, on the first prefill of a
    request with `prompt_logprobs`, one per prompt position of this chunk but the prompt's last.
    """

    request_id: str
    seq_ids: list[int]
    params: SamplingParams
    is_prompt: bool
    rows: list[int]
    seq_data: dict[int, SequenceData]
    # The request's seeded generator (None unless it has a seed); each draw re-seeds it with
    # sample_seed(seed, sample index, step).
    generator: torch.Generator | None
    # The request's very first step (a prompt run before any token exists): best_of samples
    # are drawn and prompt logprobs computed only then, never again after a recompute.
    first_step: bool = False
    # Logits rows of prompt positions prompt_start.. (each predicts prompt token i+1, up to
    # P-1); empty unless prompt_logprobs was asked for, so the common path never computes them.
    prompt_rows: list[int] = field(default_factory=list)
    # The first prefill of a request with prompt_logprobs: this step returns the prompt
    # logprobs of its chunk (prompt_start is the chunk's first position).
    want_prompt_logprobs: bool = False
    prompt_start: int = 0
    # Per row: the sample index of its sequence (SequenceData.sample_index).
    sample_indices: list[int] = field(default_factory=list)
    # Output tokens each sequence has so far (the group's samples advance in lockstep).
    step: int = 0
    # A row of a speculative decode: how many of its sequence's output tokens are drafts
    # (the structured-output matcher consumes them tentatively).
    num_drafts: int = 0
    # A row of a speculative decode (one of several groups of the request in this step).
    verify_row: bool = False


@dataclass
class VerifiedSeq:
    """One sequence of a speculative decode: the drafts it verifies and the indices in
    `SamplingMetadata.groups` of its one-row groups, one per position (len(drafts) + 1)."""

    seq_id: int
    drafts: list[int]
    positions: list[int]


@dataclass
class SamplingMetadata:
    """Rows to select from the flat hidden states, and how to sample each group.

    With speculative decodes in the step, `groups` holds for each such sequence one group
    per position it samples (each sees the drafts before it as its output so far: penalties,
    min_tokens and the seeded stream of that position apply exactly as without speculation),
    and `verified` says, per scheduled group in order, which groups are its own: a plain group
    is `None` there and its one group is `plain_index`."""

    # [S] int64: index into the step's flat token batch of each row to compute logits for.
    selected_token_indices: torch.Tensor
    groups: list[SeqGroupRows]
    # None: no speculative decode in the step (groups[i] is scheduled group i). Else per
    # scheduled group: its index in `groups` (an int) or its verified sequences.
    verified: list[int | list[VerifiedSeq]] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.selected_token_indices.numel())


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request at output position `step` (a 63-bit mix, so
    neighbouring steps and seeds give unrelated streams)."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xC2B2AE3D27D4EB4F + 0x165667B19E3779F9) % (1 << 64)
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) % (1 << 64)
    return (x ^ (x >> 29)) & ((1 << 63) - 1)


def sample_seed(seed: int, sample_index: int, step: int) -> int:
    """The generator seed of sample `sample_index` of a seeded request at output position
    `step`. Sample k draws as a request seeded `seed + k` (vLLM's parallel sampling gives
    its k-th child that seed), from a stream of its own: its tokens depend neither on its
    row in the batch nor on which of its siblings are still running -- a finished sibling
    that is still in a step scheduled ahead (the asynchronous pipeline) changes nothing."""
    return step_seed(seed + sample_index, step)


def build_sampling_metadata(
    layout: list[SequenceGroupMetadata],
    order: list[int],
    generators: dict[str, torch.Generator],
    device: torch.device,
) -> SamplingMetadata:
    """Map groups to rows, walking `layout` (the model runner's token layout: prefills first,
    then decodes); the result lists the groups in the scheduler's order, `order[i]` being the
    position in `layout` of the scheduler's i-th group (`StepRows`).

    `generators` holds one seeded generator per request, re-seeded at every draw from
    (seed, sample index, number of tokens generated so far): a sample's draws depend only on
    its own seed, index and position, so a step that is recomputed (after preemption, an
    interrupt, or the loss of a stage with its generators) draws exactly what the first
    attempt drew.
    """
    selected: list[int] = []
    groups: list[SeqGroupRows] = []
    # Per layout entry: the SeqGroupRows it adds (several for a speculative decode).
    per_entry: list[list[SeqGroupRows]] = []
    verified_of: dict[int, list[VerifiedSeq]] = {}  # layout index -> its sequences
    offset = 0
    for entry, meta in enumerate(layout):
        seq_ids = list(meta.seq_data)
        if meta.draft_token_ids is not None:
            rows_of, verified, offset = _verify_rows(meta, generators, device, selected, offset)
            per_entry.append(rows_of)
            verified_of[entry] = verified
            continue
        params = meta.sampling_params
        gen = _generator(meta, generators, device)
        # The group's sequences advance in lockstep, so any one's length is the step.
        step = meta.seq_data[seq_ids[0]].get_output_len()
        rows: list[int] = []
        sample_indices: list[int] = []
        prompt_rows: list[int] = []
        prompt_start = 0
        # The request's first prefill (no token generated yet); it samples best_of tokens
        # on its last chunk only.
        first_prefill = meta.is_prompt and all(
            meta.seq_data[s].get_output_len() == 0 for s in seq_ids
        )
        first_step = first_prefill and meta.do_sample
        want_prompt_logprobs = first_prefill and params.prompt_logprobs is not None
        if meta.is_prompt:
            # A prompt group has one sequence (or several sharing one prompt after a
            # recompute preemption of forked samples); sample each from its last token.
            for index, seq_id in enumerate(seq_ids):
                data = meta.seq_data[seq_id]
                start = data.get_num_computed_tokens()
                length = data.get_len() - start
                if len(seq_ids) == 1 and meta.token_chunk_size is not None:
                    length = meta.token_chunk_size
                if want_prompt_logprobs and index == 0:
                    # Positions start .. up to P-2 of this chunk predict prompt tokens.
                    num = max(0, min(start + length, data.get_prompt_len() - 1) - start)
                    prompt_rows = list(range(len(selected), len(selected) + num))
                    selected.extend(range(offset, offset + num))
                    prompt_start = start
                offset += length
                if meta.do_sample:
                    rows.append(len(selected))
                    sample_indices.append(data.sample_index)
                    selected.append(offset - 1)
        else:
            for seq_id in seq_ids:
                rows.append(len(selected))
                sample_indices.append(meta.seq_data[seq_id].sample_index)
                selected.append(offset)
                offset += 1
        per_entry.append([
            SeqGroupRows(
                meta.request_id,
                seq_ids,
                params,
                meta.is_prompt,
                rows,
                meta.seq_data,
                gen,
                first_step,
                prompt_rows,
                want_prompt_logprobs,
                prompt_start,
                sample_indices,
                step,
            )
        ])  # fmt: skip
    indices = torch.tensor(selected, dtype=torch.long, device=device)
    # Back in the scheduler's order: outputs are matched to groups positionally.
    if not verified_of:
        groups = [per_entry[position][0] for position in order]
        return SamplingMetadata(indices, groups)
    mapped: list[int | list[VerifiedSeq]] = []
    for position in order:
        base = len(groups)
        groups.extend(per_entry[position])
        if position not in verified_of:
            mapped.append(base)
            continue
        mapped.append(
            [
                VerifiedSeq(v.seq_id, v.drafts, [base + i for i in v.positions])
                for v in verified_of[position]
            ]
        )
    return SamplingMetadata(indices, groups, mapped)


def _verify_rows(
    meta: SequenceGroupMetadata,
    generators: dict[str, torch.Generator],
    device: torch.device,
    selected: list[int],
    offset: int,
) -> tuple[list[SeqGroupRows], list[VerifiedSeq], int]:
    """The one-row groups of a speculative decode (one per sequence and position, all rows
    of its tokens selected), its sequences (positions relative to the first group returned)
    and the offset after its tokens."""
    assert meta.draft_token_ids is not None
    params = meta.sampling_params
    gen = _generator(meta, generators, device)
    rows_of: list[SeqGroupRows] = []
    verified: list[VerifiedSeq] = []
    for seq_id, data in meta.seq_data.items():
        drafts = meta.draft_token_ids.get(seq_id, [])
        positions: list[int] = []
        for i in range(len(drafts) + 1):
            # Position i samples after the first i drafts: they are its output so far.
            seen = data if i == 0 else _with_drafts(data, drafts[:i])
            positions.append(len(rows_of))
            rows_of.append(
                SeqGroupRows(
                    meta.request_id, [seq_id], params, False, [len(selected)], {seq_id: seen},
                    gen, sample_indices=[data.sample_index], step=seen.get_output_len(),
                    num_drafts=i, verify_row=True,
                )
            )  # fmt: skip
            selected.append(offset + i)
        offset += len(drafts) + 1
        verified.append(VerifiedSeq(seq_id, drafts, positions))
    return rows_of, verified, offset


def _generator(
    meta: SequenceGroupMetadata, generators: dict[str, torch.Generator], device: torch.device
) -> torch.Generator | None:
    """The request's seeded generator (made on its first draw), None unless it has a seed."""
    if meta.sampling_params.sampling_type != SamplingType.RANDOM_SEED:
        return None
    gen = generators.get(meta.request_id)
    if gen is None:
        gen = generators[meta.request_id] = torch.Generator(device=device)
    return gen


def _with_drafts(data: SequenceData, drafts: list[int]) -> SequenceData:
    """The sequence as a position after `drafts` sees it (the prompt list is shared)."""
    return SequenceData(
        data.prompt_token_ids, data.output_token_ids + drafts, data.cumulative_logprob,
        data.eos_token_id, data.get_num_computed_tokens(), data.stage, data.sample_index,
    )  # fmt: skip
