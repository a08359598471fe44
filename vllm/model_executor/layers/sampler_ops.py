"""Logits transformations of the sampler, in vLLM V0's order: the request's token
constraints (allowed_token_ids, logit_bias: the OpenAI server's processors in vLLM), logits
processors, min_tokens, penalties, temperature, top-k/top-p, min-p.

Every function touches only the rows of groups that use its feature, and returns at once (no
tensor work, no per-row Python) when no group in the batch does: penalties, processors and
filters cost nothing for requests that do not ask for them.

Each takes `failed` (request id -> why), skips the groups already in it and adds the groups
whose own work raises: a request's bad processor or parameter fails that request, never the
step (see vllm/request_failure.py).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from vllm.model_executor.sampling_metadata import SamplingMetadata, SeqGroupRows
from vllm.request_failure import describe

Failures = dict[str, str]  # request id -> what raised


def _live(md: SamplingMetadata, failed: Failures) -> list[SeqGroupRows]:
    return [g for g in md.groups if g.request_id not in failed]


def _guarded(
    fn: Callable[[torch.Tensor, list[SeqGroupRows]], None],
    logits: torch.Tensor,
    groups: list[SeqGroupRows],
    failed: Failures,
    where: str,
) -> None:
    """`fn` over all `groups` at once; if it raises, group by group, so only the groups that
    raise on their own fail. `fn` must write `logits` only at its very end (one index_copy),
    so a failed batched attempt left nothing behind to apply twice."""
    try:
        fn(logits, groups)
        return
    except Exception:  # noqa: BLE001 - attributed below, group by group
        pass
    for group in groups:
        try:
            fn(logits, [group])
        except Exception as exc:
            failed[group.request_id] = describe(exc, where)


_SAMPLING_EPS = 1e-5


def _num_params(proc: Any) -> int:
    try:
        return len(inspect.signature(proc).parameters)
    except (TypeError, ValueError):  # builtins without a signature: the two-argument form
        return 2


def apply_token_constraints(logits: torch.Tensor, md: SamplingMetadata, failed: Failures) -> None:
    """`allowed_token_ids` (every other token's logit to -inf) and `logit_bias` (added to the
    named tokens' logits), on sample rows only, as vLLM's processors for these fields do."""
    for group in _live(md, failed):
        params = group.params
        allowed, bias = params.allowed_token_ids, params.logit_bias
        if not group.rows or (allowed is None and not bias):
            continue
        try:
            rows = torch.tensor(group.rows, dtype=torch.long, device=logits.device)
            if allowed is not None:
                mask = torch.full((logits.shape[1],), float("-inf"), device=logits.device)
                mask[torch.tensor(allowed, dtype=torch.long, device=logits.device)] = 0.0
                logits[rows] += mask  # [R, V] + [V]
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
                values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
                logits[rows.unsqueeze(1), ids.unsqueeze(0)] += values  # [R, B] += [B]
        except Exception as exc:
            failed[group.request_id] = describe(exc, "allowed_token_ids / logit_bias")


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata, failed: Failures) -> None:
    """vLLM's processors: (output_ids, logits_row) or (prompt_ids, output_ids, logits_row)
    -> new logits_row, applied to sample rows only (never to prompt-logprob rows). A
    processor that raises or returns something that is not a row of logits fails its request
    (its row is left as it was)."""
    for group in _live(md, failed):
        processors = group.params.logits_processors
        if not processors:
            continue
        try:
            for seq_id, row in zip(group.seq_ids, group.rows):
                data = group.seq_data[seq_id]
                logits_row = logits[row]
                for proc in processors:
                    if _num_params(proc) == 3:
                        logits_row = proc(
                            list(data.prompt_token_ids), list(data.output_token_ids), logits_row
                        )
                    else:
                        logits_row = proc(list(data.output_token_ids), logits_row)
                logits[row] = logits_row
        except Exception as exc:
            failed[group.request_id] = describe(exc, "a logits processor")


def apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata, failed: Failures) -> None:
    """Until a sequence has min_tokens output tokens, its stop tokens (stop_token_ids and the
    EOS ids, even with ignore_eos, as in vLLM) cannot be sampled."""
    _guarded(_min_tokens, logits, _live(md, failed), failed, "min_tokens")


def _min_tokens(logits: torch.Tensor, groups: list[SeqGroupRows]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    for group in groups:
        min_tokens = group.params.min_tokens
        if min_tokens <= 0:
            continue
        for seq_id, row in zip(group.seq_ids, group.rows):
            data = group.seq_data[seq_id]
            if data.get_output_len() >= min_tokens:
                continue
            stop_ids = set(group.params.all_stop_token_ids)
            if data.eos_token_id is not None:
                stop_ids.add(data.eos_token_id)
            stop_ids = {t for t in stop_ids if 0 <= t < logits.shape[1]}
            rows.extend([row] * len(stop_ids))
            cols.extend(stop_ids)
    if rows:
        logits[rows, cols] = float("-inf")


def _needs_penalties(group: SeqGroupRows) -> bool:
    p = group.params
    return (
        abs(p.repetition_penalty - 1.0) >= _SAMPLING_EPS
        or abs(p.frequency_penalty) >= _SAMPLING_EPS
        or abs(p.presence_penalty) >= _SAMPLING_EPS
    )


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata, failed: Failures) -> None:
    """vLLM's penalties on sample rows. Repetition (HF's rule: divide positive, multiply
    negative logits of tokens seen in the prompt or the output), then frequency (times the
    count in the output) and presence (once if in the output), as in the OpenAI API.
    Work is proportional to the sequence length, not to the vocabulary."""
    for group in _live(md, failed):
        if not _needs_penalties(group):
            continue
        try:
            _penalize(logits, group)
        except Exception as exc:
            failed[group.request_id] = describe(exc, "the penalties")


def _penalize(logits: torch.Tensor, group: SeqGroupRows) -> None:
    device = logits.device
    p = group.params
    for seq_id, row in zip(group.seq_ids, group.rows):
        data = group.seq_data[seq_id]
        out_ids = torch.tensor(data.output_token_ids, dtype=torch.long, device=device)
        if abs(p.repetition_penalty - 1.0) >= _SAMPLING_EPS:
            prompt_ids = torch.tensor(data.prompt_token_ids, dtype=torch.long, device=device)
            seen = torch.cat([prompt_ids, out_ids]).unique()
            vals = logits[row, seen]
            logits[row, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if out_ids.numel() and (
            abs(p.frequency_penalty) >= _SAMPLING_EPS or abs(p.presence_penalty) >= _SAMPLING_EPS
        ):
            ids, counts = out_ids.unique(return_counts=True)
            penalty = p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
            logits[row, ids] -= penalty


# Top-p looks at this many most likely tokens first; a full sort (~3.6 ms per 49k-token row
# on CPU, more than the lm_head matmul) is needed only for rows whose nucleus is larger.
_TOP_P_CANDIDATES = 1024


def _top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep every token at least as likely as the k-th most likely one (ties kept, as in
    vLLM); top_k [N] with V meaning off. A partial topk instead of a full sort."""
    off = top_k >= logits.shape[1]
    k_max = int(top_k[~off].max())
    kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(max=k_max) - 1).unsqueeze(1))
    kth = kth.masked_fill(off.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p_mask(
    sorted_logits: torch.Tensor, row_lse: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits sorted in descending order: which to keep (a token is dropped once the
    probability mass strictly before it reaches p -- vLLM's rule, the top token always kept),
    and whether the kept set ends inside these columns."""
    probs = (sorted_logits - row_lse.unsqueeze(1)).exp()
    cum = probs.cumsum(dim=-1)
    keep = (cum - probs) < top_p.unsqueeze(1)
    keep[:, 0] = True
    return keep, cum[:, -1] >= top_p


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's top-p on [N, V] rows (top_p [N], 1 = off), after top-k masking."""
    vocab = logits.shape[1]
    row_lse = torch.logsumexp(logits, dim=-1)
    num = min(vocab, _TOP_P_CANDIDATES)
    vals, idx = logits.topk(num, dim=-1)
    keep, complete = _top_p_mask(vals, row_lse, top_p)
    complete |= top_p >= 1.0
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(1, idx, vals.masked_fill(~keep, float("-inf")))
    off = (top_p >= 1.0).nonzero().squeeze(1)
    if off.numel():
        out.index_copy_(0, off, logits.index_select(0, off))
    if not bool(complete.all()):
        rest = (~complete).nonzero().squeeze(1)
        vals, idx = logits.index_select(0, rest).sort(dim=-1, descending=True)
        keep, _ = _top_p_mask(vals, row_lse.index_select(0, rest), top_p.index_select(0, rest))
        filtered = torch.full_like(vals, float("-inf"))
        out.index_copy_(0, rest, filtered.scatter_(1, idx, vals.masked_fill(~keep, float("-inf"))))
    return out


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely token."""
    probs = logits.softmax(dim=-1)
    floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


def apply_temperature_and_filters(
    logits: torch.Tensor, md: SamplingMetadata, failed: Failures
) -> None:
    """Temperature (greedy counts as 1, so its logprobs are the model's), top-k/top-p and
    min-p, on sample rows and -- as in vLLM V0 -- on the group's prompt-logprob rows."""
    groups = _live(md, failed)
    _guarded(_temperature, logits, groups, failed, "temperature")
    _guarded(_filters, logits, _live(md, failed), failed, "top-k/top-p/min-p")


def _group_rows(group: SeqGroupRows) -> list[int]:
    return group.prompt_rows + group.rows if group.prompt_rows else group.rows


def _temperature(logits: torch.Tensor, groups: list[SeqGroupRows]) -> None:
    temp_rows: list[int] = []
    temps: list[float] = []
    for group in groups:
        p = group.params
        if p.temperature >= _SAMPLING_EPS and abs(p.temperature - 1.0) >= _SAMPLING_EPS:
            rows = _group_rows(group)
            temp_rows.extend(rows)
            temps.extend([p.temperature] * len(rows))
    if temp_rows:
        device = logits.device
        idx = torch.tensor(temp_rows, dtype=torch.long, device=device)
        scaled = logits.index_select(0, idx).div_(torch.tensor(temps, device=device).unsqueeze(1))
        logits.index_copy_(0, idx, scaled)


def _filters(logits: torch.Tensor, groups: list[SeqGroupRows]) -> None:
    filter_rows: list[int] = []
    top_ks: list[int] = []
    top_ps: list[float] = []
    min_ps: list[float] = []
    vocab = logits.shape[1]
    for group in groups:
        p = group.params
        if p.top_k > 0 or p.top_p < 1.0 - _SAMPLING_EPS or p.min_p > _SAMPLING_EPS:
            rows = _group_rows(group)
            filter_rows.extend(rows)
            # top_k beyond the vocabulary keeps every token (and must not overflow int64).
            top_ks.extend([min(p.top_k, vocab) if p.top_k > 0 else vocab] * len(rows))
            top_ps.extend([p.top_p] * len(rows))
            min_ps.extend([p.min_p] * len(rows))
    if not filter_rows:
        return
    device = logits.device
    idx = torch.tensor(filter_rows, dtype=torch.long, device=device)
    sub = logits.index_select(0, idx)
    k = torch.tensor(top_ks, dtype=torch.long, device=device)
    if any(value < vocab for value in top_ks):
        sub = _top_k(sub, k)
    if any(value < 1.0 - _SAMPLING_EPS for value in top_ps):
        sub = _top_p(sub, torch.tensor(top_ps, dtype=logits.dtype, device=device))
    if any(value > _SAMPLING_EPS for value in min_ps):
        sub = _min_p(sub, torch.tensor(min_ps, dtype=logits.dtype, device=device))
    logits.index_copy_(0, idx, sub)
