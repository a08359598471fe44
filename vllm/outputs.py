"""What `generate` returns: vLLM's RequestOutput and CompletionOutput (torch-free)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from vllm.sampling_params import RequestOutputKind
from vllm.sequence import (
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    SampleLogprobs,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestMetrics",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "output_of_group",
]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    `index` is the sequence's position in its group; `logprobs` (when asked for) holds one
    `{token_id: Logprob}` dict per generated token, and `cumulative_logprob` their sum (None
    when logprobs were not asked for, as in vLLM 0.5.4); `finish_reason` is "stop", "length" or
    "abort" once finished; `stop_reason` is the stop string or stop token id that ended it."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason})"
        )


def _text_to_return(seq: Sequence, buffer_length: int) -> str:
    # While running, hold back the characters that may be the start of a stop string.
    if buffer_length and not seq.is_finished():
        return seq.output_text[:-buffer_length]
    return seq.output_text


def _completion(
    seq: Sequence, index: int, buffer_length: int, want_logprobs: bool, delta: bool
) -> CompletionOutput:
    text = _text_to_return(seq, buffer_length)
    token_ids = seq.get_output_token_ids()
    logprobs = seq.output_logprobs if want_logprobs else None
    if delta:
        # Only what this sequence's previous output did not carry; the held-back text of a
        # possible stop string is never returned, so the text sent so far is always a prefix.
        text_start, token_start = seq.delta_offsets
        seq.delta_offsets = (len(text), len(token_ids))
        text = text[text_start:]
        token_ids = token_ids[token_start:]
        logprobs = logprobs[token_start:] if logprobs is not None else None
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=list(token_ids),
        cumulative_logprob=seq.get_cumulative_logprob() if want_logprobs else None,
        logprobs=logprobs,
        finish_reason=SequenceStatus.get_finished_reason(seq.status),
        stop_reason=seq.stop_reason,
    )


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its (best `n`) completions so far.

    `prompt_logprobs` (when asked for) starts with None for the first prompt token. `metrics`
    is a snapshot of the request's timings when this output was built. With
    `output_kind=DELTA` the completions hold only what is new since the previous output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None

    @classmethod
    def from_seq_group(cls, seq_group: SequenceGroup) -> RequestOutput:
        """Build from a group: the top `n` sequences, best first, by cumulative logprob (by
        beam score under beam search), finished or not."""
        params = seq_group.sampling_params
        seqs = seq_group.get_seqs()
        if len(seqs) == 1:
            top = seqs
        elif params.use_beam_search:
            lp = params.length_penalty
            top = sorted(seqs, key=lambda s: s.get_beam_search_score(lp), reverse=True)[: params.n]
        else:
            top = sorted(seqs, key=lambda s: s.get_cumulative_logprob(), reverse=True)[: params.n]
        position = {seq.seq_id: i for i, seq in enumerate(seqs)}
        delta = params.output_kind == RequestOutputKind.DELTA
        outputs = [
            _completion(
                seq,
                position[seq.seq_id],
                params.output_text_buffer_length,
                params.logprobs is not None,
                delta,
            )
            for seq in top
        ]
        return cls(
            request_id=seq_group.request_id,
            prompt=seq_group.prompt,
            prompt_token_ids=list(seq_group.prompt_token_ids),
            prompt_logprobs=seq_group.prompt_logprobs,
            outputs=outputs,
            finished=seq_group.is_finished(),
            metrics=copy.copy(seq_group.metrics),
        )

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics})"
        )


@dataclass
class PoolingOutput:
    """The pooled output of one request: `data` is a torch tensor ([hidden] for a sequence
    pooling, [tokens, hidden] for ALL, [labels] for a classifier), as vLLM's."""

    data: Any

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PoolingOutput):
            return NotImplemented
        return bool((self.data == other.data).all())


_O = TypeVar("_O")


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """What `LLM.encode` / `AsyncLLMEngine.encode` return for one request (vLLM's)."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_seq_group(cls, seq_group: SequenceGroup) -> PoolingRequestOutput[PoolingOutput]:
        """The group's pooled data (None until it finished; an aborted request has none)."""
        return PoolingRequestOutput(
            request_id=seq_group.request_id,
            outputs=PoolingOutput(seq_group.pooled_data),
            prompt_token_ids=list(seq_group.prompt_token_ids),
            finished=seq_group.is_finished(),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(request_id={self.request_id!r}, outputs={self.outputs!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, finished={self.finished})"
        )


def _as_list(data: Any) -> list[float]:
    if data is None:
        raise ValueError("the request has no pooled data (it was aborted or failed)")
    values = data.tolist() if hasattr(data, "tolist") else data
    return [values] if isinstance(values, (int, float)) else list(values)


@dataclass
class EmbeddingOutput:
    """One embedding vector (vLLM's)."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        data = pooling_output.data
        if data is not None and getattr(data, "ndim", 1) != 1:
            raise ValueError("pooled_data should be a 1-D embedding vector")
        return EmbeddingOutput(_as_list(data))

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """`LLM.embed`'s output for one prompt."""

    @staticmethod
    def from_base(request_output: PoolingRequestOutput[Any]) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            request_id=request_output.request_id,
            outputs=EmbeddingOutput.from_base(request_output.outputs),
            prompt_token_ids=request_output.prompt_token_ids,
            finished=request_output.finished,
        )


@dataclass
class ClassificationOutput:
    """The class probabilities of one prompt (vLLM's)."""

    probs: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ClassificationOutput:
        data = pooling_output.data
        if data is not None and getattr(data, "ndim", 1) != 1:
            raise ValueError("pooled_data should be a 1-D probability vector")
        return ClassificationOutput(_as_list(data))

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    def __repr__(self) -> str:
        return f"ClassificationOutput(num_classes={self.num_classes})"


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """`LLM.classify`'s output for one prompt."""

    @staticmethod
    def from_base(request_output: PoolingRequestOutput[Any]) -> ClassificationRequestOutput:
        return ClassificationRequestOutput(
            request_id=request_output.request_id,
            outputs=ClassificationOutput.from_base(request_output.outputs),
            prompt_token_ids=request_output.prompt_token_ids,
            finished=request_output.finished,
        )


@dataclass
class ScoringOutput:
    """The similarity score of one pair (vLLM's)."""

    score: float

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ScoringOutput:
        values = _as_list(pooling_output.data)
        if len(values) != 1:
            raise ValueError("pooled_data should be a scalar score")
        return ScoringOutput(float(values[0]))

    def __repr__(self) -> str:
        return f"ScoringOutput(score={self.score})"


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """`LLM.score`'s output for one pair."""

    @staticmethod
    def from_base(request_output: PoolingRequestOutput[Any]) -> ScoringRequestOutput:
        return ScoringRequestOutput(
            request_id=request_output.request_id,
            outputs=ScoringOutput.from_base(request_output.outputs),
            prompt_token_ids=request_output.prompt_token_ids,
            finished=request_output.finished,
        )


# What the engine's step returns per request.
EngineOutput = RequestOutput | PoolingRequestOutput[Any]


def output_of_group(seq_group: SequenceGroup) -> EngineOutput:
    """The output the engine returns for a group: pooled for a pooling request."""
    if seq_group.pooling_params is not None:
        return PoolingRequestOutput.from_seq_group(seq_group)
    return RequestOutput.from_seq_group(seq_group)
