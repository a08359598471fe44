"""POST /v1/responses (stateless): the input and instructions through the chat template (as
/v1/chat/completions renders messages), one engine request, and OpenAI's response object, or
its stream of typed events (`response.created` ... `response.output_text.delta` ...
`response.completed`)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vllm.entrypoints.openai.protocol import ParameterError
from vllm.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    message_item,
    new_ids,
    output_text_part,
    response_object,
    usage_object,
)
from vllm.entrypoints.openai.serving_chat import render_chat
from vllm.entrypoints.openai.serving_completion import _chain, start_all
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    bad_request,
    check_structured_outputs,
    error_body,
    final_output,
)
from vllm.outputs import RequestOutput


def _padding(delta: str) -> str:
    """OpenAI's stream obfuscation: random characters that bring a delta event's text up to a
    multiple of 32 characters (at least 8 added), so its size says little about the text."""
    size = 32 - (len(delta) % 32)
    size = size + 32 if size < 8 else size
    return secrets.token_urlsafe(size)[:size]


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) of a finished output: cut by the token limit is
    `incomplete` with reason `max_output_tokens`, as OpenAI reports it."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


class OpenAIServingResponses(OpenAIServing):
    """Handles /v1/responses with the chat handler's template (`chat_template`)."""

    def __init__(self, *args: Any, chat_template: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Any:
        error = self.check_model(request.model)
        if error is not None:
            return error
        try:
            request.check_stateless()
            params = request.to_sampling_params()
            prompt, token_ids = await self._render(request, params)
        except ParameterError as exc:
            if exc.param == "max_tokens":  # this API's name for it
                exc = ParameterError(str(exc), "max_output_tokens")
            return bad_request(exc)
        except ValueError as exc:
            return bad_request(exc)
        param = "text" if request.text is not None else "structured_outputs"
        error = await check_structured_outputs(self.engine, params, param)
        if error is not None:
            return error
        response_id, item_id, created_at = new_ids()
        engine_input = {"prompt": prompt, "prompt_token_ids": token_ids}
        self.log_inputs(response_id, engine_input, params)
        lora = self.lora_request(request.model)
        generator = self.engine.generate(engine_input, params, response_id, lora)
        firsts, error = await start_all(raw_request, [generator], self.prompt_limit, "input")
        if error is not None:
            return error
        stream = _chain(*firsts[0])
        ids = (response_id, item_id, created_at)
        if request.stream:
            return StreamingResponse(
                self._stream(request, ids, stream, len(token_ids)),
                media_type="text/event-stream",
            )

        final: RequestOutput = await final_output(raw_request, stream)
        out = final.outputs[0]
        status, reason = _status(out.finish_reason)
        body = response_object(
            request,
            response_id,
            created_at,
            self.model_name,
            status,
            [message_item(item_id, out.text, "completed")],
            usage_object(len(final.prompt_token_ids), len(out.token_ids)),
            reason,
        )
        return JSONResponse(body)

    async def _render(self, request: ResponsesRequest, params: Any) -> tuple[str, list[int]]:
        """The prompt and its ids; with `truncation="auto"`, OpenAI's rule when it does not fit
        the context: drop input items from the beginning (the instructions stay, and at
        least the last item)."""
        messages = request.messages()
        while True:
            chat = SimpleNamespace(
                messages=messages,
                add_generation_prompt=True,
                reasoning_effort=request.reasoning_effort,
            )
            prompt, token_ids = await render_chat(self.work, chat, self.chat_template)
            try:
                self.check_context(len(token_ids), params, "input")
                return prompt, token_ids
            except ParameterError:
                first = next(
                    (i for i, m in enumerate(messages) if m["role"] != "system"), len(messages)
                )
                if request.truncation != "auto" or first >= len(messages) - 1:
                    raise
                messages = messages[:first] + messages[first + 1 :]

    async def _stream(
        self,
        request: ResponsesRequest,
        ids: tuple[str, str, int],
        stream: Any,
        num_prompt_tokens: int,
    ) -> AsyncIterator[str]:
        response_id, item_id, created_at = ids
        sequence = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        def response(status: str, output: list[Any], **kw: Any) -> dict[str, Any]:
            return response_object(
                request, response_id, created_at, self.model_name, status, output, **kw
            )

        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=response("in_progress", []))
        yield event("response.in_progress", response=response("in_progress", []))
        yield event(
            "response.output_item.added",
            output_index=0,
            item=message_item(item_id, None, "in_progress"),
        )
        yield event("response.content_part.added", **where, part=output_text_part(""))
        text = ""
        generated = 0
        finish_reason = None
        obfuscate = request.include_obfuscation
        try:
            async for output in stream:
                out = output.outputs[0]
                generated += len(out.token_ids)
                if out.text:
                    text += out.text
                    pad = {"obfuscation": _padding(out.text)} if obfuscate else {}
                    yield event(
                        "response.output_text.delta", **where, delta=out.text, logprobs=[], **pad
                    )
                if out.finish_reason is not None:
                    finish_reason = out.finish_reason
        except Exception as exc:  # after the headers: OpenAI's error event, then stop
            body = error_body(exc)
            yield event("error", code=str(body.code), message=body.message, param=body.param)
            return
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part=output_text_part(text))
        item = message_item(item_id, text, "completed")
        yield event("response.output_item.done", output_index=0, item=item)
        status, reason = _status(finish_reason)
        final = response(
            status,
            [item],
            usage=usage_object(num_prompt_tokens, generated),
            incomplete_reason=reason,
        )
        yield event(f"response.{status}", response=final)
