"""The pooling routes' request and response bodies (pydantic), with vLLM's names and fields:
`/v1/embeddings` (OpenAI's request plus vLLM's extras), `/pooling`, `/score`, `/rerank` (Jina /
Cohere style) and `/classify`.

Each request turns into a `PoolingParams` with `to_pooling_params()`; the handler then sets the
task (`embed`, `classify`, `score`, `encode`) and the engine checks the values, so a bad one
comes back as the engine's ValueError (a 400 naming the parameter).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from vllm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo, random_uuid

# OpenAI's `input`: a string, a list of strings, token ids or a list of token id lists.
EmbeddingInput = list[int] | list[list[int]] | str | list[str]


def _pooling_params(**fields: Any) -> Any:
    from vllm.pooling_params import PoolingParams

    # Unset fields stay at PoolingParams' defaults (the model's pooler config fills them in).
    return PoolingParams(**{k: v for k, v in fields.items() if v is not None})


class _PoolingExtras(OpenAIBaseModel):
    """vLLM's extra fields shared by every pooling request."""

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = Field(
        default=0,
        description="The request's priority (lower first). Any other value than 0 is refused "
        "unless the engine schedules by priority.",
    )
    request_id: str = Field(
        default_factory=random_uuid,
        description="The id the request carries through the engine and in the response.",
    )

    def to_pooling_params(self) -> Any:
        """The PoolingParams of the pooling fields this kind of request has; unset ones stay at
        PoolingParams' defaults (the model's pooler config fills them in)."""
        # Declared fields only: an unknown field sent along is logged, never passed on.
        declared = type(self).model_fields
        return _pooling_params(**{n: getattr(self, n) for n in _POOLING_FIELDS if n in declared})


# The request fields that are PoolingParams fields (each request kind has some of them).
_POOLING_FIELDS = (
    "truncate_prompt_tokens",
    "dimensions",
    "normalize",
    "use_activation",
    "softmax",
    "activation",
)


class EmbeddingCompletionRequest(_PoolingExtras):
    """`POST /v1/embeddings` with OpenAI's `input`
    (https://platform.openai.com/docs/api-reference/embeddings/create)."""

    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = Field(
        default=True, description="Add the tokenizer's special tokens (BOS, CLS...) to the input."
    )
    normalize: bool | None = None


class EmbeddingChatRequest(_PoolingExtras):
    """`POST /v1/embeddings` with chat `messages` (vLLM's extension): the chat template's
    output is embedded."""

    messages: list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_generation_prompt: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    normalize: bool | None = None


EmbeddingRequest = EmbeddingCompletionRequest | EmbeddingChatRequest


class PoolingCompletionRequest(EmbeddingCompletionRequest):
    """`POST /pooling`: the pooler's output as it is (per token for `encode`), `input` as for
    embeddings; `task` picks the pooler (default: `encode` where the model has it, else the
    model's own task)."""

    task: str | None = None
    use_activation: bool | None = None
    softmax: bool | None = None  # older name of use_activation
    activation: bool | None = None  # older name of use_activation


class PoolingChatRequest(EmbeddingChatRequest):
    """`POST /pooling` with chat `messages`."""

    task: str | None = None
    use_activation: bool | None = None
    softmax: bool | None = None  # older name of use_activation
    activation: bool | None = None  # older name of use_activation


PoolingRequest = PoolingCompletionRequest | PoolingChatRequest


class ScoreRequest(_PoolingExtras):
    """`POST /score`: `text_1` against `text_2`, 1:1, 1:N or N:N (a cross-encoder scores each
    pair; an embedding model gives the cosine similarity of the two embeddings)."""

    text_1: list[str] | str
    text_2: list[str] | str
    use_activation: bool | None = None
    activation: bool | None = None  # older name of use_activation


class RerankRequest(_PoolingExtras):
    """`POST /rerank`, `/v1/rerank`, `/v2/rerank` (Jina's and Cohere's API): the documents
    ranked by their score against the query; `top_n` 0 (the default) returns them all."""

    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)
    return_documents: bool = Field(
        default=True, description="Include each document's text in its result."
    )
    use_activation: bool | None = None
    activation: bool | None = None  # older name of use_activation


class ClassificationRequest(_PoolingExtras):
    """`POST /classify`: each input's class probabilities and its most likely label."""

    input: list[str] | str
    user: str | None = None
    use_activation: bool | None = None
    activation: bool | None = None  # older name of use_activation


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str  # a base64 string of little-endian float32 with "base64"


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    data: list[list[float]] | list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"pool-{random_uuid()}")
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"score-{random_uuid()}")
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str | None = None


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"classify-{random_uuid()}")
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo
