"""Logprob entries for sampled tokens and prompt tokens, in vLLM's format:
`{token_id: Logprob(logprob, rank)}` -- the chosen token first, then the top-k (ranks 1..k).

`StepLogprobs` holds one step's log-probabilities without materialising [N, vocab] unless a
request needs whole rows: the sampled token's logprob is `logit - logsumexp(row)`; rows of
requests that asked for logprobs (ranks, top-k), prompt logprobs or beam search get a real
log_softmax. The rank pass ([n, vocab] comparisons) and top-k run only for those requests.
"""

from __future__ import annotations

import torch

from vllm.model_executor.sampling_metadata import SeqGroupRows
from vllm.sequence import Logprob, PromptLogprobs

# (logits row, parent sequence id, token id), as produced by the sampler.
Draw = tuple[int, int, int]


class StepLogprobs:
    """Log-probabilities of the step's logits rows, materialised only where needed.

    logits [N, V] (after the sampler's processing); lse [N] = logsumexp of each row;
    full_rows: the rows whose whole log_softmax is needed (computed once, here).
    """

    def __init__(self, logits: torch.Tensor, lse: torch.Tensor, full_rows: list[int]) -> None:
        self.logits = logits
        self.lse = lse
        self._full_pos = {row: i for i, row in enumerate(full_rows)}
        self._full: torch.Tensor | None = None  # [len(full_rows), V]
        if full_rows:
            if full_rows == list(range(logits.shape[0])):
                selected = logits
            else:
                selected = logits.index_select(0, self._long(full_rows))
            self._full = torch.log_softmax(selected, dim=-1)

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.logits.device)

    def rows(self, rows: list[int]) -> torch.Tensor:
        """log_softmax of `rows` (each one of full_rows) -> [len(rows), V]."""
        assert self._full is not None, "rows() needs the rows listed in full_rows"
        positions = [self._full_pos[row] for row in rows]
        if positions == list(range(self._full.shape[0])):
            return self._full
        return self._full.index_select(0, self._long(positions))

    def gather(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """The logprob of tokens[i] in rows[i] -> [len(rows)] float32. Rows of full_rows read
        their log_softmax, so ranks and cumulative logprobs agree with it exactly."""
        out = torch.empty(len(rows), dtype=self.logits.dtype, device=self.logits.device)
        exact = [i for i, row in enumerate(rows) if row in self._full_pos]
        cheap = [i for i, row in enumerate(rows) if row not in self._full_pos]
        if exact:
            assert self._full is not None
            pos = self._long([self._full_pos[rows[i]] for i in exact])
            out[self._long(exact)] = self._full[pos, self._long([tokens[i] for i in exact])]
        if cheap:
            r = self._long([rows[i] for i in cheap])
            t = self._long([tokens[i] for i in cheap])
            out[self._long(cheap)] = self.logits[r, t] - self.lse[r]
        return out


def _ranks(selected: torch.Tensor, token_lps: torch.Tensor) -> list[int]:
    """1 + the number of tokens strictly more likely than the chosen one, per row."""
    return ((selected > token_lps.unsqueeze(1)).sum(dim=-1) + 1).tolist()


def logprob_rows_needed(groups: list[SeqGroupRows], beam_groups: list[SeqGroupRows]) -> list[int]:
    """The rows whose whole log_softmax this step needs: sample rows of requests with
    `logprobs` set or beam search, and prompt rows of first steps with `prompt_logprobs`."""
    rows: list[int] = []
    beam = {id(g) for g in beam_groups}
    for group in groups:
        if group.params.logprobs is not None or id(group) in beam:
            rows.extend(group.rows)
        if group.want_prompt_logprobs:
            rows.extend(group.prompt_rows)
    return sorted(set(rows))


def build_logprob_entries(
    logprobs: StepLogprobs,
    num_logprobs: list[int | None],
    draws: list[list[Draw]],
) -> list[list[dict[int, Logprob]]]:
    """One entry per draw, grouped like `draws`. A group with `logprobs=None` gets the bare
    logprob of its token (the engine needs it for cumulative_logprob); with `logprobs=k` the
    entry also carries the token's rank and the k most likely tokens."""
    flat = [(g, r, t) for g, group_draws in enumerate(draws) for r, _, t in group_draws]
    if not flat:
        return [[] for _ in draws]
    device = logprobs.logits.device
    token_lp_t = logprobs.gather([r for _, r, _ in flat], [t for _, _, t in flat])
    token_lps = token_lp_t.tolist()

    ranked = [i for i, (g, _, _) in enumerate(flat) if num_logprobs[g] is not None]
    ranks: dict[int, int] = {}
    tops: dict[int, tuple[list[int], list[float]]] = {}
    if ranked:
        selected = logprobs.rows([flat[i][1] for i in ranked])
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


def build_prompt_logprobs(logprobs: StepLogprobs, group: SeqGroupRows) -> PromptLogprobs:
    """[None, then per prompt token 1..P-1 its entry: the actual token (logprob, rank) and the
    `prompt_logprobs` most likely tokens]. The first token has no context, hence None.

    A prefill chunk returns the entries of its own positions only (the None only with the
    first chunk); the engine joins the chunks in order."""
    data = group.seq_data[group.seq_ids[0]]
    start = group.prompt_start
    targets = data.prompt_token_ids[start + 1 : start + 1 + len(group.prompt_rows)]
    result: PromptLogprobs = [None] if start == 0 else []
    if not targets:
        return result
    token_lp_t = logprobs.gather(group.prompt_rows, targets)
    lps = token_lp_t.tolist()
    selected = logprobs.rows(group.prompt_rows)
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
