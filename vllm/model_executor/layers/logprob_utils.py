"""Logprob entries for sampled tokens and prompt tokens, in vLLM's format:
`{token_id: Logprob(logprob, rank)}` -- the chosen token first, then the top-k (ranks 1..k).

Gathered from the step's log_softmax; the rank pass ([n, vocab] comparisons) and top-k run
only for requests that asked for logprobs.
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm.model_executor.sampling_metadata import SeqGroupRows
from vllm.sequence import Logprob, PromptLogprobs

# (logits row, parent sequence id, token id), as produced by the sampler.
Draw = tuple[int, int, int]


def _select_rows(logprobs: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logprobs[rows] -- without a copy in the common case of every row, in order."""
    if rows == list(range(logprobs.shape[0])):
        return logprobs
    return logprobs.index_select(0, torch.tensor(rows, dtype=torch.long, device=logprobs.device))


def _ranks(selected: torch.Tensor, token_lps: torch.Tensor) -> list[int]:
    """1 + the number of tokens strictly more likely than the chosen one, per row."""
    return ((selected > token_lps.unsqueeze(1)).sum(dim=-1) + 1).tolist()


def build_logprob_entries(
    logprobs: torch.Tensor,
    num_logprobs: list[Optional[int]],
    draws: list[list[Draw]],
) -> list[list[dict[int, Logprob]]]:
    """One entry per draw, grouped like `draws`. A group with `logprobs=None` gets the bare
    logprob of its token (the engine needs it for cumulative_logprob); with `logprobs=k` the
    entry also carries the token's rank and the k most likely tokens."""
    flat = [(g, r, t) for g, group_draws in enumerate(draws) for r, _, t in group_draws]
    if not flat:
        return [[] for _ in draws]
    device = logprobs.device
    rows = torch.tensor([r for _, r, _ in flat], dtype=torch.long, device=device)
    tokens = torch.tensor([t for _, _, t in flat], dtype=torch.long, device=device)
    token_lp_t = logprobs[rows, tokens]
    token_lps = token_lp_t.tolist()

    ranked = [i for i, (g, _, _) in enumerate(flat) if num_logprobs[g] is not None]
    ranks: dict[int, int] = {}
    tops: dict[int, tuple[list[int], list[float]]] = {}
    if ranked:
        selected = _select_rows(logprobs, [flat[i][1] for i in ranked])
        if len(ranked) == len(flat):
            ranked_lps = token_lp_t
        else:
            ranked_lps = token_lp_t[torch.tensor(ranked, dtype=torch.long, device=device)]
        ranks = dict(zip(ranked, _ranks(selected, ranked_lps)))
        k_max = max(num_logprobs[flat[i][0]] or 0 for i in ranked)
        if k_max:
            # One topk over the ranked rows; each entry keeps its own request's k.
            top_vals, top_ids = selected.topk(k_max, dim=-1)
            for i, ids, lps in zip(ranked, top_ids.tolist(), top_vals.tolist()):
                tops[i] = (ids, lps)

    result: list[list[dict[int, Logprob]]] = [[] for _ in draws]
    for i, (g, _, token) in enumerate(flat):
        entry = {token: Logprob(token_lps[i], ranks.get(i))}
        top = tops.get(i)
        k = num_logprobs[g] or 0
        if top is not None and k:
            for rank, (tid, lp) in enumerate(zip(top[0][:k], top[1][:k]), start=1):
                entry[tid] = Logprob(lp, rank)
        result[g].append(entry)
    return result


def build_prompt_logprobs(logprobs: torch.Tensor, group: SeqGroupRows) -> PromptLogprobs:
    """[None, then per prompt token 1..P-1 its entry: the actual token (logprob, rank) and the
    `prompt_logprobs` most likely tokens]. The first token has no context, hence None."""
    data = group.seq_data[group.seq_ids[0]]
    targets = data.prompt_token_ids[1:]
    result: PromptLogprobs = [None]
    if not targets:
        return result
    device = logprobs.device
    rows = torch.tensor(group.prompt_rows, dtype=torch.long, device=device)
    target_t = torch.tensor(targets, dtype=torch.long, device=device)
    token_lp_t = logprobs[rows, target_t]
    lps = token_lp_t.tolist()
    selected = logprobs.index_select(0, rows)
    ranks = _ranks(selected, token_lp_t)
    k = group.params.prompt_logprobs or 0
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    if k:
        vals, ids = selected.topk(k, dim=-1)
        top_ids = ids.tolist()
        top_lps = vals.tolist()
    for i, token in enumerate(targets):
        entry = {token: Logprob(lps[i], ranks[i])}
        if k:
            for rank, (tid, lp) in enumerate(zip(top_ids[i], top_lps[i]), start=1):
                entry[tid] = Logprob(lp, rank)
        result.append(entry)
    return result
