"""POST /score and /rerank (also /v1/score, /v1/rerank, /v2/rerank): sentence-transformers'
cross-encoder scores, or for an embedding model the cosine similarity of the two texts'
embeddings, as vLLM serves them.

`/score` pairs `text_1` with `text_2` 1:1, 1:N or N:N; `/rerank` scores `query` against each
document and returns them best first (Jina's and Cohere's shape: `top_n`, `return_documents`).
A cross-encoder reads each pair as one input, `[CLS] a [SEP] b [SEP]` with the token types the
tokenizer gives (0 for a, 1 for b).
"""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm.entrypoints.openai.protocol import ParameterError, UsageInfo, random_uuid
from vllm.entrypoints.openai.protocol_pooling import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from vllm.entrypoints.openai.serving_embedding import embedding_of
from vllm.entrypoints.openai.serving_pooling_base import PoolingServing, pooling_bad_request


def validate_score_input_lens(data_1: list[str], data_2: list[str]) -> None:
    """vLLM's checks (and messages) of the two sides' lengths."""
    if len(data_1) > 1 and len(data_1) != len(data_2):
        raise ParameterError("Input lengths must be either 1:1, 1:N or N:N", "text_2")
    if not data_1:
        raise ParameterError("At least one text element must be given", "text_1")
    if not data_2:
        raise ParameterError("At least one text_pair element must be given", "text_2")


def cosine(a: list[float], b: list[float]) -> float:
    """torch's CosineSimilarity (eps 1e-8) of two vectors."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / max(norm, 1e-8)


class ServingScores(PoolingServing):
    """Handles /score and /rerank."""

    task = "score"
    api = "Score"

    @property
    def cross_encoder(self) -> bool:
        """A classifier with one label scores pairs; an embedding model scores by cosine
        (as `LLM.score`)."""
        return getattr(self.model_config, "convert_type", None) != "embed"

    def unsupported_score(self, api: str) -> JSONResponse | None:
        return self.unsupported("score", api)

    async def scores(
        self,
        raw_request: Request,
        request: ScoreRequest | RerankRequest,
        data_1: list[str],
        data_2: list[str],
        request_id: str,
    ) -> tuple[list[float], int] | JSONResponse:
        """Each pair's score and the prompt tokens they took (a 400/500 body if refused)."""
        try:
            self.check_priority(request.priority)
            truncate = self.effective_truncation(request.truncate_prompt_tokens)
            if len(data_1) == 1:
                data_1 = data_1 * len(data_2)
            self.check_count(len(data_2), "text_2")
            if self.cross_encoder:
                params = self.pooling_params(request, "score")
                inputs = [await self.pair_input(a, b, truncate) for a, b in zip(data_1, data_2)]
            else:
                params = self.pooling_params(request, "embed")
                if params.use_activation is not None or params.activation is not None:
                    raise ParameterError(
                        "use_activation applies to cross-encoder scores; this model scores "
                        "by the cosine similarity of embeddings.",
                        "use_activation",
                    )
                inputs = await self.engine_inputs(data_1 + data_2, True, truncate, "text_1")
        except ValueError as exc:
            return pooling_bad_request(exc)
        outputs = await self.encode_all(raw_request, request_id, inputs, params, request.model)
        if isinstance(outputs, JSONResponse):
            return outputs
        if self.cross_encoder:
            from vllm.outputs import ScoringRequestOutput

            scores = [ScoringRequestOutput.from_base(o).outputs.score for o in outputs]
            return scores, sum(len(o.prompt_token_ids) for o in outputs)
        n = len(data_1)
        firsts, seconds = outputs[:n], outputs[n:]
        scores = [cosine(embedding_of(a), embedding_of(b)) for a, b in zip(firsts, seconds)]
        # vLLM counts each pair's tokens (both texts and a pad token between them).
        pad = 1 if getattr(self.tokenizer, "pad_token_id", None) is not None else 0
        tokens = sum(
            len(a.prompt_token_ids) + pad + len(b.prompt_token_ids) for a, b in zip(firsts, seconds)
        )
        return scores, tokens

    async def pair_input(self, text_1: str, text_2: str, truncate: int | None) -> dict[str, Any]:
        """One cross-encoder input: the pair tokenized together, with its token types."""
        for text, param in ((text_1, "text_1"), (text_2, "text_2")):
            self.work.check_prompt_chars(text, param)

        def tokenize() -> Any:
            kwargs: dict[str, Any] = {}
            if truncate is not None:
                kwargs = {"truncation": True, "max_length": truncate}
            return self.tokenizer(text_1, text_pair=text_2, **kwargs)

        encoded = await self.work.run(tokenize)
        ids = list(encoded["input_ids"])
        self.check_length(len(ids), None, "text_2")
        engine_input: dict[str, Any] = {"prompt_token_ids": ids}
        types = encoded.get("token_type_ids")
        if types is not None and getattr(self.model_config, "is_encoder_only", False):
            engine_input["token_type_ids"] = list(types)  # as LLM.score: encoders only
        return engine_input

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Any:
        error = self.check_model(request.model) or self.unsupported_score("Score")
        if error is not None:
            return error
        data_1 = [request.text_1] if isinstance(request.text_1, str) else list(request.text_1)
        data_2 = [request.text_2] if isinstance(request.text_2, str) else list(request.text_2)
        try:
            validate_score_input_lens(data_1, data_2)
        except ValueError as exc:
            return pooling_bad_request(exc)
        request_id = f"score-{request.request_id or random_uuid()}"
        created = int(time.time())
        result = await self.scores(raw_request, request, data_1, data_2, request_id)
        if isinstance(result, JSONResponse):
            return result
        scores, tokens = result
        body = ScoreResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            data=[ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)],
            usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens),
        )
        return JSONResponse(body.model_dump())

    async def do_rerank(self, request: RerankRequest, raw_request: Request) -> Any:
        error = self.check_model(request.model) or self.unsupported_score("Rerank (Score)")
        if error is not None:
            return error
        documents = list(request.documents)
        if not documents:
            return pooling_bad_request(ParameterError("documents must not be empty.", "documents"))
        request_id = f"rerank-{request.request_id or random_uuid()}"
        result = await self.scores(raw_request, request, [request.query], documents, request_id)
        if isinstance(result, JSONResponse):
            return result
        scores, tokens = result
        # Best first; equal scores keep the documents' order.
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[: request.top_n]
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=documents[i]) if request.return_documents else None,
                relevance_score=scores[i],
            )
            for i in order
        ]
        body = RerankResponse(
            id=request_id,
            model=self.model_name,
            usage=RerankUsage(total_tokens=tokens),
            results=results,
        )
        return JSONResponse(body.model_dump(exclude_none=not request.return_documents))
