"""The sampler: logits -> next tokens with their logprobs, on the last pipeline stage.

Order as in vLLM V0: logits processors, min_tokens, penalties, temperature, top-k/top-p,
min-p (sampler_ops.py), then greedy argmax, a seeded/unseeded random draw, or beam-search
candidates; logprobs come from the processed distribution.

Greedy rows take the argmax; every logprob is a gather from one log_softmax; ranks and top-k
entries are computed only for requests that asked for logprobs.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.logprob_utils import (
    Draw,
    build_logprob_entries,
    build_prompt_logprobs,
)
from vllm.model_executor.layers.sampler_ops import (
    apply_logits_processors,
    apply_min_tokens,
    apply_penalties,
    apply_temperature_and_filters,
)
from vllm.model_executor.sampling_metadata import SamplingMetadata, SeqGroupRows
from vllm.sampling_params import SamplingType
from vllm.sequence import SamplerOutput, SequenceGroupOutput, SequenceOutput


def num_beam_candidates(group: SeqGroupRows) -> int:
    """Candidates per beam step: HF keeps max(2, 1 + #stop tokens) * beam_width so that
    beam_width beams can go on even if the best ones all end (vLLM V0: 2 * beam_width)."""
    params = group.params
    stop_ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        eos = next(iter(group.seq_data.values())).eos_token_id
        if eos is not None:
            stop_ids.add(eos)
    return max(2, 1 + len(stop_ids)) * params.best_of


def _beam_candidates(logprobs: torch.Tensor, group: SeqGroupRows, vocab: int) -> list[Draw]:
    """The top candidates over all (beam, token) pairs by cumulative logprob, best first.
    The first step has one parent (the prompt), so its candidates are its top tokens."""
    rows = torch.tensor(group.rows, dtype=torch.long, device=logprobs.device)
    cums = [group.seq_data[s].cumulative_logprob for s in group.seq_ids]
    scores = logprobs.index_select(0, rows)
    scores += torch.tensor(cums, dtype=scores.dtype, device=scores.device).unsqueeze(1)
    k = min(num_beam_candidates(group), scores.numel())
    draws = []
    for index in scores.flatten().topk(k).indices.tolist():
        parent = index // vocab
        draws.append((group.rows[parent], group.seq_ids[parent], index % vocab))
    return draws


def _random_draws(logits: torch.Tensor, groups: list[SeqGroupRows]) -> dict[int, list[Draw]]:
    """Multinomial draws for all random groups at once by vLLM's exponential race: argmax of
    p / q with q ~ Exp(1) per token. A token only changes when two ratios nearly tie, so the
    draw survives the ~1e-6 logit noise between prefill (recompute) and decode, or between
    stage thread counts -- inverse-CDF sampling would not: fp32 cumsum error is as wide as a
    token in a flat distribution. q = -log(u) costs ~5x less than torch's exponential_ on CPU.

    Each seeded group draws its q rows from its own generator in one call, so its tokens do
    not depend on the rest of the batch or on the number of stages. On the first step a group
    draws best_of samples from its single prompt row."""
    rows: list[int] = []
    parents: list[int] = []
    spans: list[tuple[int, int, SeqGroupRows]] = []
    # Unseeded groups first (one call to the global generator), then one block per seeded one.
    for group in sorted(groups, key=lambda g: g.generator is not None):
        start = len(rows)
        repeat = group.params.best_of if group.first_step else 1
        for seq_id, row in zip(group.seq_ids, group.rows):
            rows.extend([row] * repeat)
            parents.extend([seq_id] * repeat)
        spans.append((start, len(rows), group))
    device = logits.device
    probs = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
    probs = probs.softmax(dim=-1)
    vocab = probs.shape[1]
    num_unseeded = sum(end - start for start, end, g in spans if g.generator is None)
    tokens: list[int] = []
    if num_unseeded:
        # Unseeded rows promise no reproducibility, so they take inverse-CDF sampling: one
        # uniform per row instead of one per vocabulary entry (~6x cheaper at 128 x 49k).
        cdf = probs[:num_unseeded].cumsum(dim=-1)
        # u > 0, so a leading zero-probability token (cdf 0) can never be picked.
        u = torch.rand(num_unseeded, 1, device=device).clamp_(min=1e-12) * cdf[:, -1:]
        picked = torch.searchsorted(cdf, u).clamp_(max=vocab - 1).squeeze(1)
        tokens.extend(picked.tolist())
    seeded = [
        torch.rand(end - start, vocab, generator=group.generator, device=device)
        for start, end, group in spans
        if group.generator is not None
    ]
    if seeded:
        # u in [0, 1): -log(u) is in (0, inf], so q is never 0 and p / q never NaN (a
        # filtered token has p = 0 and can never win).
        q = (seeded[0] if len(seeded) == 1 else torch.cat(seeded)).log_().neg_()
        tokens.extend(probs[num_unseeded:].div_(q).argmax(dim=-1).tolist())
    out: dict[int, list[Draw]] = {}
    for start, end, group in spans:
        out[id(group)] = [(rows[i], parents[i], tokens[i]) for i in range(start, end)]
    return out


class Sampler:
    """Turns the last stage's logits [S, vocab] into one SequenceGroupOutput per group."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        apply_logits_processors(logits, md)
        apply_min_tokens(logits, md)
        apply_penalties(logits, md)
        apply_temperature_and_filters(logits, md)
        vocab = logits.shape[1]
        # One fused pass; on CPU it costs less than logsumexp alone (measured), and every
        # logprob below is a gather from it.
        logprobs = torch.log_softmax(logits, dim=-1)

        draws: dict[int, list[Draw]] = {}
        greedy_groups = []
        random_groups = []
        for group in md.groups:
            kind = group.params.sampling_type
            if kind == SamplingType.GREEDY:
                greedy_groups.append(group)
            elif kind == SamplingType.BEAM:
                draws[id(group)] = _beam_candidates(logprobs, group, vocab)
            else:
                random_groups.append(group)
        if greedy_groups:
            argmax = logits.argmax(dim=-1).tolist()
            for group in greedy_groups:
                draws[id(group)] = [
                    (row, seq_id, argmax[row]) for seq_id, row in zip(group.seq_ids, group.rows)
                ]
        if random_groups:
            draws.update(_random_draws(logits, random_groups))

        ordered = [draws[id(group)] for group in md.groups]
        entries = build_logprob_entries(logprobs, [g.params.logprobs for g in md.groups], ordered)
        outputs: SamplerOutput = []
        for group, group_draws, group_entries in zip(md.groups, ordered, entries):
            samples = [
                SequenceOutput(parent, token, entry)
                for (_, parent, token), entry in zip(group_draws, group_entries)
            ]
            prompt_logprobs = None
            if group.first_step and group.params.prompt_logprobs is not None:
                prompt_logprobs = build_prompt_logprobs(logprobs, group)
            outputs.append(SequenceGroupOutput(samples, prompt_logprobs))
        return outputs
