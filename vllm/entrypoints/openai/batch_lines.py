"""One line of an OpenAI batch file, read and run: shared by `vllm run-batch` and the online
`/v1/batches`.

A line is `{"custom_id", "method": "POST", "url", "body"}`; its result is vLLM's
`BatchRequestOutput` line `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`. The body goes through the server's own handlers (`OpenAIServingCompletion`,
`OpenAIServingChat`), so a line is validated and answered exactly as the same body sent to
`/v1/completions` or `/v1/chat/completions`. A line that cannot run (not JSON, an unknown url,
an invalid body, `stream: true`) gets an error line of its own (status 400 and the error body
the server would send); the other lines run.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from vllm.engine.async_llm_engine import AsyncEngineDeadError
from vllm.entrypoints.openai.protocol import (
    BatchRequestInput,
    BatchRequestOutput,
    BatchResponseData,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    random_uuid,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.logger import init_logger
from vllm.request_failure import RequestFailedError

logger = init_logger("vllm.entrypoints.openai.batch_lines")

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
SUPPORTED_URLS = (COMPLETIONS, CHAT_COMPLETIONS)


def error_output(
    custom_id: str | None,
    message: str,
    param: str | None = None,
    status: HTTPStatus = HTTPStatus.BAD_REQUEST,
    err_type: str = "BadRequestError",
) -> BatchRequestOutput:
    """The line of a request that failed: vLLM's error body under `error`."""
    error = ErrorResponse(message=message, type=err_type, param=param, code=status.value)
    return BatchRequestOutput(
        id=f"vllm-{random_uuid()}",
        custom_id=custom_id,
        response=BatchResponseData(status_code=status.value, request_id=_request_id()),
        error=error.model_dump(),
    )


def _request_id() -> str:
    return f"vllm-batch-{random_uuid()}"


def parse_line(text: str, line_no: int) -> BatchRequestInput | BatchRequestOutput:
    """The request on line `line_no` (1-based) of a batch file, or the error line it gets.
    A line that is not a JSON object has no custom_id to report: its error line has
    `custom_id` None and names the line number."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return error_output(None, f"Line {line_no} is not valid JSON: {exc}.")
    if not isinstance(data, dict):
        return error_output(None, f"Line {line_no} is not a JSON object.")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str):
        return error_output(None, f"Line {line_no}: custom_id must be a string.", param="custom_id")
    try:
        request = BatchRequestInput.model_validate(data)
    except ValidationError as exc:
        return error_output(custom_id, f"Line {line_no}: {exc}", param=_loc(exc))
    if request.method.upper() != "POST":
        return error_output(
            custom_id,
            f"Line {line_no}: method {request.method!r} is not supported; use POST.",
            param="method",
        )
    return request


def parse_lines(text: str) -> list[BatchRequestInput | BatchRequestOutput]:
    """Each non-empty line of a batch file: its request, or the error line it gets."""
    rows = enumerate(text.splitlines(), start=1)
    return [parse_line(line, no) for no, line in rows if line.strip()]


def _loc(exc: ValidationError) -> str | None:
    errors = exc.errors()
    loc = [str(p) for p in errors[0].get("loc", ())] if errors else []
    return loc[0] if loc else None


async def _never_disconnects() -> dict[str, Any]:
    """The ASGI receive of a request with no client: it never reports a disconnect (the
    handlers watch for one to abort their requests; a batch line is aborted by cancelling
    its task instead)."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _batch_request(url: str) -> Request:
    scope = {"type": "http", "method": "POST", "path": url, "headers": [], "query_string": b""}
    return Request(scope, receive=_never_disconnects)


class BatchLineRunner:
    """Runs batch lines through the server's completion and chat handlers."""

    def __init__(self, completion: OpenAIServingCompletion, chat: OpenAIServingChat) -> None:
        self.completion = completion
        self.chat = chat

    async def run(
        self, request: BatchRequestInput, endpoint: str | None = None
    ) -> BatchRequestOutput:
        """The output line of one request. `endpoint` (a /v1/batches job's) refuses lines for
        another url. AsyncEngineDeadError propagates: the engine is gone (or shutting down),
        the line did not run; the caller decides what that means."""
        custom_id = request.custom_id
        url = request.url
        if endpoint is not None and url != endpoint:
            return error_output(
                custom_id,
                f"The url {url} does not match the batch's endpoint {endpoint}.",
                param="url",
            )
        if url == EMBEDDINGS:
            return error_output(
                custom_id,
                "The model does not support Embeddings API (this server generates text: "
                f"use {COMPLETIONS} or {CHAT_COMPLETIONS}).",
                param="url",
            )
        if url not in SUPPORTED_URLS:
            return error_output(
                custom_id,
                f"URL {url} was used. Supported endpoints: {', '.join(SUPPORTED_URLS)}.",
                param="url",
            )
        body: CompletionRequest | ChatCompletionRequest
        try:
            if url == COMPLETIONS:
                body = CompletionRequest.model_validate(request.body)
            else:
                body = ChatCompletionRequest.model_validate(request.body)
        except ValidationError as exc:
            # As the server's RequestValidationError handler: 400 naming the field.
            return error_output(custom_id, str(exc), param=_loc(exc))
        if body.stream:
            return error_output(
                custom_id, "Request must not be sent in stream mode", param="stream"
            )
        raw = _batch_request(url)
        try:
            if isinstance(body, CompletionRequest):
                response = await self.completion.create_completion(body, raw)
            else:
                response = await self.chat.create_chat_completion(body, raw)
        except AsyncEngineDeadError:
            raise
        except Exception as exc:  # e.g. RequestFailedError: this line alone fails (500)
            if not isinstance(exc, RequestFailedError):
                logger.exception("Batch line %s failed", custom_id)
            return error_output(
                custom_id,
                str(exc),
                status=HTTPStatus.INTERNAL_SERVER_ERROR,
                err_type="InternalServerError",
            )
        if not isinstance(response, JSONResponse):
            return error_output(custom_id, "Request must not be sent in stream mode")
        data = json.loads(bytes(response.body))
        if response.status_code == HTTPStatus.OK:
            return BatchRequestOutput(
                id=f"vllm-{random_uuid()}",
                custom_id=custom_id,
                response=BatchResponseData(request_id=_request_id(), body=data),
            )
        return BatchRequestOutput(
            id=f"vllm-{random_uuid()}",
            custom_id=custom_id,
            response=BatchResponseData(status_code=response.status_code, request_id=_request_id()),
            error=data,
        )
