"""What the last stage needs to sample: which hidden rows to turn into logits and, per row,
the group, sequence and sampling parameters (built from the scheduler's metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.sampling_params import SamplingParams, SamplingType
from vllm.sequence import SequenceData, SequenceGroupMetadata


@dataclass
class SeqGroupRows:
    """The logits rows of one scheduled group: one per running sequence (one for a prompt),
    plus, on a first prompt step with `prompt_logprobs`, one per prompt position but the last."""

    request_id: str
    seq_ids: list[int]
    params: SamplingParams
    is_prompt: bool
    rows: list[int]
    seq_data: dict[int, SequenceData]
    generator: torch.Generator | None
    # The request's very first step (a prompt run before any token exists): best_of samples
    # are drawn and prompt logprobs computed only then, never again after a recompute.
    first_step: bool = False
    # Logits rows of prompt positions 0..P-2 (each predicts prompt token i+1); empty unless
    # prompt_logprobs was asked for, so the common path never computes them.
    prompt_rows: list[int] = field(default_factory=list)


@dataclass
class SamplingMetadata:
    """Rows to select from the flat hidden states, and how to sample each group."""

    # [S] int64: index into the step's flat token batch of each row to compute logits for.
    selected_token_indices: torch.Tensor
    groups: list[SeqGroupRows]

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


def build_sampling_metadata(
    metadata_list: list[SequenceGroupMetadata],
    generators: dict[str, torch.Generator],
    device: torch.device,
) -> SamplingMetadata:
    """Map groups to rows. Layout matches the model runner: prefills first, then decodes.

    `generators` holds one seeded generator per request, re-seeded at every step from
    (seed, number of tokens generated so far): a request's draws depend only on its own seed
    and position, so a step that is recomputed (after preemption, an interrupt, or the loss of
    a stage with its generators) draws exactly what the first attempt drew.
    """
    prefills = [m for m in metadata_list if m.is_prompt]
    decodes = [m for m in metadata_list if not m.is_prompt]
    selected: list[int] = []
    groups: list[SeqGroupRows] = []
    offset = 0
    for meta in prefills + decodes:
        seq_ids = list(meta.seq_data)
        params = meta.sampling_params
        gen = None
        if params.sampling_type == SamplingType.RANDOM_SEED:
            gen = generators.get(meta.request_id)
            if gen is None:
                gen = torch.Generator(device=device)
                generators[meta.request_id] = gen
            # The group's sequences advance in lockstep, so any one's length is the step.
            step = meta.seq_data[seq_ids[0]].get_output_len()
            gen.manual_seed(step_seed(params.seed, step))
        rows: list[int] = []
        prompt_rows: list[int] = []
        first_step = meta.is_prompt and all(meta.seq_data[s].get_output_len() == 0 for s in seq_ids)
        if meta.is_prompt:
            # A prompt group has one sequence (or several sharing one prompt after a
            # recompute preemption of forked samples); sample each from its last token.
            for seq_id in seq_ids:
                seq_len = meta.seq_data[seq_id].get_len()
                if first_step and params.prompt_logprobs is not None and not prompt_rows:
                    prompt_rows = list(range(len(selected), len(selected) + seq_len - 1))
                    selected.extend(range(offset, offset + seq_len - 1))
                offset += seq_len
                rows.append(len(selected))
                selected.append(offset - 1)
        else:
            for _ in seq_ids:
                rows.append(len(selected))
                selected.append(offset)
                offset += 1
        groups.append(
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
            )
        )
    # Put groups back in the scheduler's order: outputs are matched to groups positionally.
    order = {id(meta): i for i, meta in enumerate(prefills + decodes)}
    groups = [groups[order[id(meta)]] for meta in metadata_list]
    indices = torch.tensor(selected, dtype=torch.long, device=device)
    return SamplingMetadata(indices, groups)
