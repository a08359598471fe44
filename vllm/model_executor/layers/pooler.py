"""The pooler (last stage): a pooling request's final hidden states to its output.

vLLM's pooling types: LAST (the last prompt token; a classifier takes HF's last non-padding
token), CLS (the first), MEAN (over every prompt token), ALL (every token's output), STEP
(the outputs at `step_tag_id` tokens, `returned_token_ids` columns). Then the task's head: an
embedding is truncated to `dimensions` (Matryoshka) and L2-normalised when asked; a classifier
applies its head (the model's `score` / `classifier`) and, with `use_activation`, a sigmoid for
one label or a softmax over several (vLLM's rule for scores and class probabilities).

`PoolingBuffer` keeps, on the last stage, the hidden states of a chunked prompt's earlier
chunks until its last chunk arrives (MEAN, ALL, STEP and CLS need them).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

# The model's classification head: pooled [N, H] -> logits [N, num_labels].
ClassifyHead = Callable[[torch.Tensor], torch.Tensor]

EMBED_TASKS = ("embed", "token_embed")
CLASSIFY_TASKS = ("classify", "score", "token_classify")


class PoolingStateLost(RuntimeError):
    """The last stage lacks the hidden states of a chunked prompt's earlier chunks (it was
    replaced after they passed): the request must be recomputed from its first token."""


class PoolingBuffer:
    """Hidden states of the earlier chunks of chunked pooling prompts, by request id."""

    def __init__(self) -> None:
        # request id -> (first prompt position held, list of [n_i, H] chunks)
        self._chunks: dict[str, tuple[int, list[torch.Tensor]]] = {}

    def add(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """Keep chunk `hidden` [n, H] of the prompt positions from `start`; a chunk from
        position 0 starts the prompt again (a recompute)."""
        held = self._chunks.get(request_id)
        if held is None or start == 0:
            self._chunks[request_id] = (start, [hidden.clone()])
            return
        first, chunks = held
        if first + sum(c.shape[0] for c in chunks) != start:
            # A gap (a chunk this stage never saw): what it holds cannot be completed.
            self._chunks[request_id] = (start, [hidden.clone()])
            return
        chunks.append(hidden.clone())

    def take(self, request_id: str, start: int, hidden: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The last chunk `hidden` (from `start`) joined after the held ones: (the first
        position covered, [n, H]); the request's entry is dropped."""
        held = self._chunks.pop(request_id, None)
        if held is None or start == 0:
            return start, hidden
        first, chunks = held
        if first + sum(c.shape[0] for c in chunks) != start:
            return start, hidden
        return first, torch.cat([*chunks, hidden], dim=0)

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._chunks.pop(request_id, None)

    def clear(self) -> None:
        self._chunks.clear()


def last_token_index(token_ids: list[int], pad_token_id: int | None) -> int:
    """HF's sequence-classification rule: the last token that is not padding (the first
    position when every token is padding); the last token when there is no pad id."""
    if pad_token_id is None:
        return len(token_ids) - 1
    for i in range(len(token_ids) - 1, -1, -1):
        if token_ids[i] != pad_token_id:
            return i
    return 0


def pool(
    hidden: torch.Tensor,
    first: int,
    token_ids: list[int],
    params: Any,
    pooling_type: str,
    head: ClassifyHead | None,
    pad_token_id: int | None = None,
) -> torch.Tensor:
    """One request's output.

    hidden [n, H]: the final hidden states of prompt positions [first, first + n) (`first` >
    0 only when a cached prefix was skipped, which LAST alone allows); token_ids: the whole
    prompt; params: its verified PoolingParams; head: the classifier head (None for an
    embedder). Returns a float32 tensor: [H'] / [labels] for a sequence pooling, [n, ...] for
    ALL / STEP."""
    total = len(token_ids)
    if first + hidden.shape[0] != total:
        raise PoolingStateLost(
            f"the last stage holds prompt positions [{first}, {first + hidden.shape[0]}) of {total}"
        )
    if pooling_type in ("MEAN", "ALL", "STEP", "CLS") and first != 0:
        raise PoolingStateLost(f"{pooling_type} pooling needs every prompt position")
    if pooling_type == "LAST":
        index = last_token_index(token_ids, pad_token_id) if head is not None else total - 1
        if index < first:
            raise PoolingStateLost("the pooled token's hidden state is not on this stage")
        pooled = hidden[index - first]  # [H]
    elif pooling_type == "CLS":
        pooled = hidden[0]  # [H]
    elif pooling_type == "MEAN":
        pooled = hidden.float().mean(dim=0)  # [H]
    elif pooling_type in ("ALL", "STEP"):
        pooled = hidden  # [n, H]
    else:
        raise ValueError(f"Unsupported pooling type: {pooling_type}")
    task = params.task
    if task in EMBED_TASKS or (task == "encode" and head is None):
        return _embed_head(pooled.float(), params)
    if head is None:
        raise ValueError(f"Task {task} needs a classification head; this model has none.")
    logits = head(pooled.to(hidden.dtype).unsqueeze(0) if pooled.dim() == 1 else pooled)
    logits = logits.float()  # [1 or n, labels]
    if pooling_type == "STEP":
        if params.returned_token_ids:
            logits = logits[:, params.returned_token_ids]
        logits = _activation(logits, params.use_activation)
        if params.step_tag_id is not None:
            keep = torch.tensor(token_ids, device=logits.device) == params.step_tag_id
            logits = logits[keep]
        return logits
    logits = _activation(logits, params.use_activation)
    return logits[0] if pooled.dim() == 1 else logits


def _embed_head(pooled: torch.Tensor, params: Any) -> torch.Tensor:
    """Matryoshka truncation, then L2 normalisation (vLLM's order)."""
    if params.dimensions is not None:
        pooled = pooled[..., : params.dimensions]
    if params.normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled


def _activation(logits: torch.Tensor, use_activation: bool | None) -> torch.Tensor:
    """Sigmoid for one label, softmax over several (when asked)."""
    if not use_activation:
        return logits
    if logits.shape[-1] == 1:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
