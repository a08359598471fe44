"""POST /v1/chat/completions: the tokenizer's chat template makes the prompt (as `LLM.chat`
does, so greedy replies are the same), then one engine request with `n` choices, streamed as
`chat.completion.chunk` events or returned whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vllm.entrypoints.openai.bounded_work import BoundedWork, check_unicode
from vllm.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatMessage,
    DeltaMessage,
    ParameterError,
    UsageInfo,
    random_uuid,
)
from vllm.entrypoints.openai.serving_completion import _chain, start_all, token_text
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    bad_request,
    error_body,
    sse,
    until_disconnected,
)
from vllm.outputs import RequestOutput
from vllm.sequence import Logprob


def _text_content(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ParameterError("only text content parts are supported.", "messages")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise ParameterError("message content must be a string or a list of parts.", "messages")


def chat_prompt(tokenizer: Any, request: Any, chat_template: Optional[str] = None) -> str:
    """Apply the chat template to the request's messages (raises ParameterError)."""
    if tokenizer is None:
        raise ParameterError("chat needs a tokenizer (skip_tokenizer_init is set).", "messages")
    messages = []
    for message in request.messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ParameterError("each message needs a 'role'.", "messages")
        content = _text_content(message.get("content"))
        role = message["role"]
        if not isinstance(role, str):
            raise ParameterError("a message's 'role' must be a string.", "messages")
        check_unicode(role, "messages")
        check_unicode(content, "messages")
        messages.append({"role": role, "content": content})
    template = getattr(request, "chat_template", None) or chat_template
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            chat_template=template,
        )
    except Exception as exc:  # no template, a template error or its time budget: a 400
        raise ParameterError(f"cannot apply the chat template: {exc}", "messages") from exc


UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


async def render_chat(
    work: BoundedWork, request: Any, chat_template: Optional[str]
) -> tuple[str, list[int]]:
    """The chat prompt and its token ids, rendered and tokenized in the bounded-work pool (a
    request's own template only with --trust-request-chat-template)."""
    if getattr(request, "chat_template", None) is not None:
        if not work.limits.trust_request_chat_template:
            raise ParameterError(UNTRUSTED_TEMPLATE, "chat_template")
    tokenizer = work.tokenizer

    def render() -> tuple[str, list[int]]:
        prompt = work.render_sync(lambda: chat_prompt(tokenizer, request, chat_template))
        # The template holds the BOS token where the model wants one (as LLM.chat).
        return prompt, work.encode_sync(prompt, False, "messages")

    return await work.run(render)


def chat_logprobs(
    token_ids: list[int], steps: list[dict[int, Logprob]], tokenizer: Any, top: int
) -> ChatCompletionLogProbs:
    content = []
    for token_id, step in zip(token_ids, steps):
        chosen = step.get(token_id)
        token = token_text(chosen, token_id, tokenizer)
        ranked = sorted(step.items(), key=lambda kv: kv[1].rank if kv[1].rank else 1 << 30)
        content.append(
            ChatLogProbsContent(
                token=token,
                logprob=max(chosen.logprob, -9999.0) if chosen is not None else -9999.0,
                bytes=list(token.encode("utf-8", errors="replace")),
                top_logprobs=[
                    ChatLogProb(
                        token=(t := token_text(lp, tid, tokenizer)),
                        logprob=max(lp.logprob, -9999.0),
                        bytes=list(t.encode("utf-8", errors="replace")),
                    )
                    for tid, lp in ranked[:top]
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)


class OpenAIServingChat(OpenAIServing):
    """Handles /v1/chat/completions."""

    def __init__(self, *args: Any, chat_template: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Any:
        error = self.check_model(request.model)
        if error is not None:
            return error
        try:
            params = request.to_sampling_params()
            prompt, token_ids = await render_chat(self.work, request, self.chat_template)
            self.check_context(len(token_ids), params, "messages")
        except ValueError as exc:
            return bad_request(exc)
        request_id = f"chat-{random_uuid()}"
        created = int(time.time())
        generator = self.engine.generate(
            {"prompt": prompt, "prompt_token_ids": token_ids}, params, request_id
        )
        firsts, error = await start_all(raw_request, [generator], self.prompt_limit, "messages")
        if error is not None:
            return error
        stream = _chain(*firsts[0])
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, created, stream),
                media_type="text/event-stream",
            )

        async def collect() -> Optional[RequestOutput]:
            final = None
            async for output in stream:
                final = output
            return final

        final = await until_disconnected(raw_request, collect())
        assert final is not None
        return JSONResponse(self._response(request, request_id, created, final).model_dump())

    def _logprobs(self, request: ChatCompletionRequest, out: Any) -> Any:
        if not request.logprobs or out.logprobs is None:
            return None
        return chat_logprobs(out.token_ids, out.logprobs, self.tokenizer, request.top_logprobs or 0)

    def _response(
        self, request: ChatCompletionRequest, request_id: str, created: int, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=out.index,
                message=ChatMessage(role="assistant", content=out.text),
                logprobs=self._logprobs(request, out),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            for out in final.outputs
        ]
        choices.sort(key=lambda c: c.index)
        prompt_tokens = len(final.prompt_token_ids)
        completion_tokens = sum(len(out.token_ids) for out in final.outputs)
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
        )

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, created: int, stream: Any
    ) -> AsyncIterator[str]:
        def chunk(index: int, delta: DeltaMessage, **extra: Any) -> str:
            choice = ChatCompletionResponseStreamChoice(index=index, delta=delta, **extra)
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[choice]
                )
            )

        # vLLM's first chunk per choice carries the role only.
        for index in range(request.n):
            yield chunk(index, DeltaMessage(role="assistant", content=""))
        finished: set[int] = set()
        prompt_tokens = completion_tokens = 0
        try:
            async for output in stream:
                prompt_tokens = len(output.prompt_token_ids)
                for out in output.outputs:
                    if out.index in finished:
                        continue
                    if not out.text and not out.token_ids and out.finish_reason is None:
                        continue
                    completion_tokens += len(out.token_ids)
                    if out.finish_reason is not None:
                        finished.add(out.index)
                    yield chunk(
                        out.index,
                        DeltaMessage(content=out.text),
                        logprobs=self._logprobs(request, out),
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
            if request.stream_options is not None and request.stream_options.include_usage:
                usage = UsageInfo(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens,
                )
                yield sse(
                    ChatCompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=self.model_name,
                        choices=[],
                        usage=usage,
                    )
                )
        except Exception as exc:
            yield sse(error_body(exc))
        yield sse("[DONE]")
