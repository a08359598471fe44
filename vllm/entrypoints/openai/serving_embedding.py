"""POST /v1/embeddings: OpenAI's embeddings API (the official client's `embeddings.create`),
one engine request per input, vectors as floats or base64 (little-endian float32, what the
OpenAI client decodes), `dimensions` (Matryoshka), vLLM's `normalize` and
`truncate_prompt_tokens`, or chat `messages` through the chat template."""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from vllm.entrypoints.openai.protocol import random_uuid
from vllm.entrypoints.openai.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
)
from vllm.entrypoints.openai.serving_pooling_base import (
    PoolingServing,
    pooling_bad_request,
    usage_of,
)


def encode_vector(values: Any, encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: a list of floats, or base64 of its float32
    bytes (little-endian, as the OpenAI client decodes it with numpy)."""
    if encoding_format == "base64":
        data = np.asarray(values, dtype="<f4").tobytes()
        return base64.b64encode(data).decode("ascii")
    return [float(v) for v in values]


class OpenAIServingEmbedding(PoolingServing):
    """Handles /v1/embeddings."""

    task = "embed"
    api = "Embeddings"

    def __init__(self, *args: Any, chat_template: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Any:
        error = self.check_model(request.model) or self.unsupported()
        if error is not None:
            return error
        try:
            self.check_priority(request.priority)
            truncate = self.effective_truncation(request.truncate_prompt_tokens)
            params = self.pooling_params(request)
            inputs = await self.request_inputs(request, truncate)
        except ValueError as exc:
            return pooling_bad_request(exc)
        request_id = f"embd-{request.request_id or random_uuid()}"
        created = int(time.time())
        outputs = await self.encode_all(raw_request, request_id, inputs, params, request.model)
        if isinstance(outputs, JSONResponse):
            return outputs
        data = [
            EmbeddingResponseData(
                index=i, embedding=encode_vector(embedding_of(o), request.encoding_format)
            )
            for i, o in enumerate(outputs)
        ]
        body = EmbeddingResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            data=data,
            usage=usage_of(outputs),
        )
        return JSONResponse(body.model_dump())


def embedding_of(output: Any) -> list[float]:
    """The embedding of a finished pooling request (vLLM's EmbeddingRequestOutput view)."""
    from vllm.outputs import EmbeddingRequestOutput

    return list(EmbeddingRequestOutput.from_base(output).outputs.embedding)
