"""The sampler: logits -> next tokens with their logprobs, on the last pipeline stage.

Order as in vLLM V0: logits processors, min_tokens, penalties, temperature, top-k/top-p,
min-p (sampler_ops.py), then greedy argmax, a seeded/unseeded random draw, or beam-search
candidates; logprobs come from the processed distribution.

Greedy rows take the argmax; a sampled token's logprob is its logit minus the row's logsumexp;
whole log_softmax rows, ranks and top-k entries are computed only for requests that asked for
logprobs (or beam search).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm import _custom_ops as ops
from vllm.model_executor.layers.logprob_utils import (
    Draw,
    StepLogprobs,
    build_logprob_entries,
    build_prompt_logprobs,
    logprob_rows_needed,
)
from vllm.model_executor.layers.sampler_ops import (
    apply_logits_processors,
    apply_min_tokens,
    apply_penalties,
    apply_temperature_and_filters,
    apply_token_constraints,
)
from vllm.model_executor.sampling_metadata import SamplingMetadata, SeqGroupRows, sample_seed
from vllm.request_failure import describe
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


def _beam_candidates(logprobs: StepLogprobs, group: SeqGroupRows, vocab: int) -> list[Draw]:
    """The top candidates over all (beam, token) pairs by cumulative logprob, best first.
    The first step has one parent (the prompt), so its candidates are its top tokens."""
    cums = [group.seq_data[s].cumulative_logprob for s in group.seq_ids]
    scores = logprobs.rows(group.rows).clone()
    scores += torch.tensor(cums, dtype=scores.dtype, device=scores.device).unsqueeze(1)
    k = min(num_beam_candidates(group), scores.numel())
    draws = []
    for index in scores.flatten().topk(k).indices.tolist():
        parent = index // vocab
        draws.append((group.rows[parent], group.seq_ids[parent], index % vocab))
    return draws


class DrawPlan(NamedTuple):
    """A random group's draws: per draw, its logits row, the seq it extends and the index of
    the sample it becomes."""

    rows: list[int]
    parents: list[int]
    sample_indices: list[int]
    group: SeqGroupRows


def draw_sample_indices(parent_index: int, repeat: int) -> list[int]:
    """The sample indices of `repeat` draws from one sequence: the parent continues with the
    last draw (output_processor forks the others), and the fork from draw j is sample
    parent + 1 + j."""
    return [parent_index + 1 + j for j in range(repeat - 1)] + [parent_index]


def _draw_plan(groups: list[SeqGroupRows]) -> list[DrawPlan]:
    """One DrawPlan per random group: on its first step a group draws best_of samples from
    its single prompt row."""
    plan = []
    for group in groups:
        repeat = group.params.best_of if group.first_step else 1
        rows: list[int] = []
        parents: list[int] = []
        indices: list[int] = []
        for seq_id, row, index in zip(group.seq_ids, group.rows, group.sample_indices):
            rows.extend([row] * repeat)
            parents.extend([seq_id] * repeat)
            indices.extend(draw_sample_indices(index, repeat))
        plan.append(DrawPlan(rows, parents, indices, group))
    return plan


def _inverse_cdf_draws(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """Unseeded multinomial draws, the torch way (the C++ kernel does the same in one pass):
    one uniform per draw against the row's CDF."""
    device = logits.device
    probs = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
    cdf = probs.softmax(dim=-1).cumsum(dim=-1)
    # u > 0, so a leading zero-probability token (cdf 0) can never be picked.
    u = torch.rand(len(rows), 1, device=device).clamp_(min=1e-12) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u).clamp_(max=logits.shape[1] - 1).squeeze(1)
    return picked.tolist()


def _seeded_draws(logits: torch.Tensor, draw: DrawPlan) -> list[int]:
    """A seeded group's draws by vLLM's exponential race: argmax of p / q with q ~ Exp(1) per
    token. A token only changes when two ratios nearly tie, so the draw survives the ~1e-6
    logit noise between prefill (recompute) and decode, or between stage thread counts --
    inverse-CDF sampling would not: fp32 cumsum error is as wide as a token in a flat
    distribution. Each sample draws its q row from its own seeded stream (sample_seed), so its
    tokens depend neither on the rest of the batch, nor on its siblings, nor on the number of
    stages. q = -log(u) costs ~5x less than torch's exponential_ on CPU."""
    group = draw.group
    gen = group.generator
    assert gen is not None
    device = logits.device
    probs = logits.index_select(0, torch.tensor(draw.rows, dtype=torch.long, device=device))
    probs = probs.softmax(dim=-1)  # [D, vocab]
    q = torch.empty_like(probs)  # [D, vocab]
    for i, index in enumerate(draw.sample_indices):
        gen.manual_seed(sample_seed(group.params.seed or 0, index, group.step))
        # u in [0, 1): -log(u) is in (0, inf], so q is never 0 and p / q never NaN (a
        # filtered token has p = 0 and can never win).
        q[i] = torch.rand(probs.shape[1], generator=gen, device=device)
    return probs.div_(q.log_().neg_()).argmax(dim=-1).tolist()


class Sampler:
    """Turns the last stage's logits [S, vocab] into one SequenceGroupOutput per group."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        # Requests whose own sampling work raised: they get placeholder tokens (the stages
        # stay in step) and an error the engine fails them with; the others are unaffected.
        failed: dict[str, str] = {}
        apply_token_constraints(logits, md, failed)
        apply_logits_processors(logits, md, failed)
        apply_min_tokens(logits, md, failed)
        apply_penalties(logits, md, failed)
        apply_temperature_and_filters(logits, md, failed)
        vocab = logits.shape[1]

        greedy_groups: list[SeqGroupRows] = []
        beam_groups: list[SeqGroupRows] = []
        random_groups: list[SeqGroupRows] = []
        for group in md.groups:
            if not group.rows or group.request_id in failed:
                continue  # a prefill chunk before the end of its prompt: nothing to sample
            kind = group.params.sampling_type
            if kind == SamplingType.GREEDY:
                greedy_groups.append(group)
            elif kind == SamplingType.BEAM:
                beam_groups.append(group)
            else:
                random_groups.append(group)
        plan = _draw_plan(random_groups)
        # Unseeded requests promise no reproducibility, so they take inverse-CDF sampling:
        # one uniform per draw instead of one per vocabulary entry.
        unseeded_rows = [r for d in plan if d.group.generator is None for r in d.rows]

        # Per-row passes over the vocabulary: argmax, logsumexp and the unseeded draws, in one
        # C++ call on CPU (~10x less than torch's softmax + cumsum), else in torch.
        if ops.supports_sampling(logits):
            # 1 - u: torch.rand is in [0, 1), the kernel wants (0, 1].
            uniforms = 1.0 - torch.rand(len(unseeded_rows))
            drawn_t, argmax_t, lse = ops.sample_from_logits(
                logits, torch.tensor(unseeded_rows, dtype=torch.long), uniforms
            )
            drawn = drawn_t.tolist()
            argmax = argmax_t.tolist() if greedy_groups else []
        else:
            lse = torch.logsumexp(logits, dim=-1)
            drawn = _inverse_cdf_draws(logits, unseeded_rows) if unseeded_rows else []
            argmax = logits.argmax(dim=-1).tolist() if greedy_groups else []
        logprobs = StepLogprobs(logits, lse, logprob_rows_needed(md.groups, beam_groups))

        draws: dict[int, list[Draw]] = {}
        for group in greedy_groups:
            draws[id(group)] = [
                (row, seq_id, argmax[row]) for seq_id, row in zip(group.seq_ids, group.rows)
            ]
        for group in beam_groups:
            try:
                draws[id(group)] = _beam_candidates(logprobs, group, vocab)
            except Exception as exc:
                failed[group.request_id] = describe(exc, "beam search")
        next_drawn = 0
        for draw in plan:
            group = draw.group
            if group.generator is None:
                tokens = drawn[next_drawn : next_drawn + len(draw.rows)]
                next_drawn += len(draw.rows)
            else:
                try:
                    tokens = _seeded_draws(logits, draw)
                except Exception as exc:
                    failed[group.request_id] = describe(exc, "the seeded draw")
                    continue
            draws[id(group)] = list(zip(draw.rows, draw.parents, tokens))
        for group in md.groups:
            if group.request_id in failed:
                # Token 0 in place of a sample, so a decode scheduled ahead finds one.
                draws[id(group)] = [(row, seq, 0) for seq, row in zip(group.seq_ids, group.rows)]

        ordered = [draws.get(id(group), []) for group in md.groups]
        num_logprobs = [None if g.request_id in failed else g.params.logprobs for g in md.groups]
        entries = build_logprob_entries(logprobs, num_logprobs, ordered)
        outputs: SamplerOutput = []
        for group, group_draws, group_entries in zip(md.groups, ordered, entries):
            samples = [
                SequenceOutput(parent, token, entry)
                for (_, parent, token), entry in zip(group_draws, group_entries)
            ]
            error = failed.get(group.request_id)
            prompt_logprobs = None
            if group.want_prompt_logprobs and error is None:
                prompt_logprobs = build_prompt_logprobs(logprobs, group)
            outputs.append(SequenceGroupOutput(samples, prompt_logprobs, error))
        return outputs
