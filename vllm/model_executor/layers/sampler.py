"""The sampler: logits -> next tokens with their logprobs, on the last pipeline stage.

Order as in vLLM: logits processors, penalties, temperature, top-k/top-p/min-p, then greedy
argmax or a seeded/unseeded random draw; logprobs come from the processed distribution.
"""

from __future__ import annotations

import torch

from vllm.model_executor.sampling_metadata import SamplingMetadata, SeqGroupRows
from vllm.sampling_params import SamplingType
from vllm.sequence import Logprob, SamplerOutput, SequenceGroupOutput, SequenceOutput

_SAMPLING_EPS = 1e-5


def _apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> None:
    for group in md.groups:
        processors = group.params.logits_processors
        if not processors:
            continue
        for seq_id, row in zip(group.seq_ids, group.rows):
            output_ids = group.seq_data[seq_id].output_token_ids
            for proc in processors:
                logits[row] = proc(list(output_ids), logits[row])


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Repetition (HF rule: divide positive, multiply negative logits of seen tokens),
    then frequency and presence penalties on generated-token counts."""
    vocab = logits.shape[1]
    for group in md.groups:
        p = group.params
        if (
            abs(p.repetition_penalty - 1.0) < _SAMPLING_EPS
            and abs(p.frequency_penalty) < _SAMPLING_EPS
            and abs(p.presence_penalty) < _SAMPLING_EPS
        ):
            continue
        for seq_id, row in zip(group.seq_ids, group.rows):
            data = group.seq_data[seq_id]
            out_ids = torch.tensor(data.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
            if abs(p.repetition_penalty - 1.0) >= _SAMPLING_EPS:
                seen = torch.tensor(
                    data.get_token_ids(), dtype=torch.long, device=logits.device
                ).unique()
                vals = logits[row, seen]
                logits[row, seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
            logits[row] -= p.frequency_penalty * counts
            logits[row] -= p.presence_penalty * (counts > 0).to(logits.dtype)


def _apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, top-p nucleus and min-p floor.
    top_k [S] (vocab size = off), top_p [S], min_p [S]."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    mask = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token).
    mask |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    mask |= probs < (min_p[:, None] * probs[:, :1])
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _random_sample(probs: torch.Tensor, group: SeqGroupRows, num_samples: int) -> list[int]:
    """Draw with the exponential race (argmax p/q, q ~ Exp(1)), which equals multinomial
    sampling and lets a per-request generator make the draw reproducible."""
    rows = probs.expand(num_samples, -1) if probs.shape[0] == 1 else probs
    q = torch.empty_like(rows).exponential_(generator=group.generator)
    return (rows / q).argmax(dim=-1).tolist()


def _logprob_entry(logprobs_row: torch.Tensor, token: int, num_top: int) -> dict[int, Logprob]:
    token_lp = float(logprobs_row[token])
    entry: dict[int, Logprob] = {}
    if num_top > 0:
        rank = int((logprobs_row > token_lp).sum()) + 1
        top_lp, top_ids = logprobs_row.topk(num_top)
        for i, (tid, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist())):
            entry[tid] = Logprob(lp, i + 1)
        entry[token] = Logprob(token_lp, rank)
    else:
        entry[token] = Logprob(token_lp)
    return entry


class Sampler:
    """Turns the last stage's logits [S, vocab] into one SequenceGroupOutput per group."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        _apply_logits_processors(logits, md)
        _apply_penalties(logits, md)
        num_rows, vocab = logits.shape
        temps = torch.ones(num_rows, device=logits.device)
        top_k = torch.full((num_rows,), vocab, dtype=torch.long, device=logits.device)
        top_p = torch.ones(num_rows, device=logits.device)
        min_p = torch.zeros(num_rows, device=logits.device)
        needs_filter = False
        for group in md.groups:
            p = group.params
            if p.temperature >= _SAMPLING_EPS:
                temps[group.rows] = p.temperature
            if p.top_k > 0 or p.top_p < 1.0 - _SAMPLING_EPS or p.min_p > _SAMPLING_EPS:
                needs_filter = True
                top_k[group.rows] = p.top_k if p.top_k > 0 else vocab
                top_p[group.rows] = p.top_p
                min_p[group.rows] = p.min_p
        logits = logits / temps[:, None]
        if needs_filter:
            logits = _apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        logprobs = torch.log_softmax(logits, dim=-1)
        greedy = logits.argmax(dim=-1).tolist()
        probs = None
        outputs: SamplerOutput = []
        for group in md.groups:
            p = group.params
            if p.sampling_type == SamplingType.GREEDY:
                tokens = [[greedy[r]] for r in group.rows]
            elif p.sampling_type == SamplingType.BEAM:
                raise NotImplementedError("beam search is not implemented yet")
            else:
                if probs is None:
                    probs = logprobs.exp()
                # On the prompt step a group draws best_of samples from its one prompt row.
                n = p.best_of if group.is_prompt else 1
                tokens = [_random_sample(probs[r : r + 1], group, n) for r in group.rows]
            num_top = p.logprobs or 0
            samples = [
                SequenceOutput(seq_id, tok, _logprob_entry(logprobs[row], tok, num_top))
                for seq_id, row, toks in zip(group.seq_ids, group.rows, tokens)
                for tok in toks
            ]
            outputs.append(SequenceGroupOutput(samples))
        return outputs
