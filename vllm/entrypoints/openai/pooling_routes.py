"""The pooling routes of the OpenAI-compatible server, mounted by `api_server.build_app`:
`/v1/embeddings`, `/pooling`, `/classify`, `/score` (and `/v1/score`), `/rerank` (and
`/v1/rerank`, `/v2/rerank`), vLLM's paths. Each exists whatever the model; a model that does
not run the route's task gets vLLM's 400 ("The model does not support Embeddings API").

A body is validated against the request model its fields select (`messages`: the chat form),
so a bad field is a 400 naming that field, not the union's branch.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from vllm.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    PoolingChatRequest,
    PoolingCompletionRequest,
    RerankRequest,
    ScoreRequest,
)
from vllm.entrypoints.openai.serving_classification import ServingClassification
from vllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from vllm.entrypoints.openai.serving_engine import error_response
from vllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from vllm.entrypoints.openai.serving_score import ServingScores
from vllm.logger import init_logger

logger = init_logger("vllm.entrypoints.openai.pooling_routes")


async def parse_body(raw_request: Request, form: type[BaseModel], chat_form: Any = None) -> Any:
    """The request body as `form` (or `chat_form` when it has `messages`); a 400 response
    naming the first bad field otherwise."""
    try:
        body = json.loads(await raw_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error_response(f"The request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return error_response("The request body must be a JSON object.")
    model = chat_form if chat_form is not None and "messages" in body else form
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        loc = [str(p) for p in errors[0].get("loc", ())] if errors else []
        return error_response(str(exc), param=loc[0] if loc else None)


def attach_pooling_routes(app: FastAPI, *args: Any, **kwargs: Any) -> None:
    """Mount the pooling routes; `args` / `kwargs` are the handlers' constructor arguments
    (the engine, the served names, `work=`, `served_loras=`, `chat_template=`)."""
    chat_template = kwargs.pop("chat_template", None)
    embedding = OpenAIServingEmbedding(*args, chat_template=chat_template, **kwargs)
    pooling = OpenAIServingPooling(*args, chat_template=chat_template, **kwargs)
    classification = ServingClassification(*args, **kwargs)
    scores = ServingScores(*args, **kwargs)

    @app.post("/v1/embeddings")
    async def create_embedding(raw_request: Request) -> Any:
        request = await parse_body(raw_request, EmbeddingCompletionRequest, EmbeddingChatRequest)
        if isinstance(request, JSONResponse):
            return request
        return await embedding.create_embedding(request, raw_request)

    @app.post("/pooling")
    async def create_pooling(raw_request: Request) -> Any:
        request = await parse_body(raw_request, PoolingCompletionRequest, PoolingChatRequest)
        if isinstance(request, JSONResponse):
            return request
        return await pooling.create_pooling(request, raw_request)

    @app.post("/classify")
    async def create_classify(raw_request: Request) -> Any:
        request = await parse_body(raw_request, ClassificationRequest)
        if isinstance(request, JSONResponse):
            return request
        return await classification.create_classify(request, raw_request)

    async def score(raw_request: Request) -> Any:
        request = await parse_body(raw_request, ScoreRequest)
        if isinstance(request, JSONResponse):
            return request
        return await scores.create_score(request, raw_request)

    async def score_v1(raw_request: Request) -> Any:
        logger.warning(
            "To indicate that Score API is not part of standard OpenAI API, we have moved it "
            "to `/score`. Please update your client accordingly."
        )
        return await score(raw_request)

    async def rerank(raw_request: Request) -> Any:
        request = await parse_body(raw_request, RerankRequest)
        if isinstance(request, JSONResponse):
            return request
        return await scores.do_rerank(request, raw_request)

    app.add_api_route("/score", score, methods=["POST"])
    app.add_api_route("/v1/score", score_v1, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])
