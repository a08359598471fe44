"""POST /v1/completions: one engine request per prompt, `n` choices each (index
`prompt_index * n + i`), streamed as server-sent events in vLLM's chunk format or returned
whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vllm.engine.async_llm_engine import AsyncEngineDeadError
from vllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    ParameterError,
    UsageInfo,
    prompt_logprobs_json,
    random_uuid,
)
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    bad_request,
    check_structured_outputs,
    error_body,
    first_output,
    is_client_error,
    merge_streams,
    server_error,
    sse,
    until_disconnected,
)
from vllm.inputs import is_token_list
from vllm.outputs import RequestOutput
from vllm.sequence import Logprob

Generator = AsyncGenerator[RequestOutput, None]


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The request's prompts: a string, a list of strings, token ids, or lists of them."""
    if isinstance(prompt, str):
        return [prompt]
    if is_token_list(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(is_token_list(p) for p in prompt):
            return list(prompt)
    raise ParameterError(
        "prompt must be a string, a list of strings, a list of token ids or a list of such "
        "lists, and not empty.",
        "prompt",
    )


def token_text(logprob: Logprob | None, token_id: int, tokenizer: Any, as_id: bool = False) -> str:
    """A logprobs entry's token: `token_id:N` with --return-tokens-as-token-ids (text that
    is not valid UTF-8 on its own stays exact), else its decoded text."""
    if as_id:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def completion_logprobs(
    token_ids: list[int],
    steps: list[dict[int, Logprob] | None],
    tokenizer: Any,
    text_offset: int,
    as_id: bool = False,
) -> CompletionLogProbs:
    """OpenAI's legacy logprobs object for some tokens; a step of None (the first prompt
    token under `echo`) has no logprob, as in vLLM."""
    result = CompletionLogProbs()
    for token_id, step in zip(token_ids, steps):
        if step is None:
            token = token_text(None, token_id, tokenizer, as_id)
            result.tokens.append(token)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = step.get(token_id)
            token = token_text(chosen, token_id, tokenizer, as_id)
            result.tokens.append(token)
            result.token_logprobs.append(max(chosen.logprob, -9999.0) if chosen else None)
            result.top_logprobs.append(
                {
                    token_text(lp, tid, tokenizer, as_id): max(lp.logprob, -9999.0)
                    for tid, lp in step.items()
                }
            )
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def _echo_logprobs(
    output: RequestOutput, token_ids: list[int], steps: list[Any] | None
) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """The prompt's tokens and logprobs ahead of a choice's own (echo with logprobs)."""
    prompt_steps = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids))
    return list(output.prompt_token_ids) + list(token_ids), prompt_steps + list(steps or [])


class OpenAIServingCompletion(OpenAIServing):
    """Handles /v1/completions."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Any:
        error = self.check_model(request.model)
        if error is not None:
            return error
        try:
            params = request.to_sampling_params()
            prompts = _prompts(request.prompt)
            if len(prompts) > self.limits.max_prompts_per_request:
                raise ParameterError(
                    f"prompt holds {len(prompts)} prompts; this server takes at most "
                    f"{self.limits.max_prompts_per_request} per request "
                    "(--max-prompts-per-request).",
                    "prompt",
                )
            inputs = [await self._engine_input(p, params) for p in prompts]
        except ValueError as exc:
            return bad_request(exc)
        error = await check_structured_outputs(self.engine, params, request.structured_param)
        if error is not None:
            return error
        request_id = f"cmpl-{random_uuid()}"
        created = int(time.time())
        for i, engine_input in enumerate(inputs):
            self.log_inputs(f"{request_id}-{i}", engine_input, params)
        generators = [
            self.engine.generate(p, params, f"{request_id}-{i}", self.lora_request(request.model))
            for i, p in enumerate(inputs)
        ]

        firsts, error = await start_all(raw_request, generators, self.prompt_limit)
        if error is not None:
            return error
        streams = [_chain(first, gen) for first, gen in firsts]
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, created, streams),
                media_type="text/event-stream",
            )
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def collect() -> None:
            async for i, output in merge_streams(streams):
                finals[i] = output

        await until_disconnected(raw_request, collect())
        return JSONResponse(self._response(request, request_id, created, finals).model_dump())

    async def _engine_input(self, prompt: str | list[int], params: Any) -> dict[str, Any]:
        """The prompt as the engine takes it, tokenized here (off the event loop and off the
        engine thread) and checked against the context."""
        if isinstance(prompt, str):
            token_ids = await self.work.encode(prompt, True, "prompt")
            self.check_context(len(token_ids), params, "prompt")
            return {"prompt": prompt, "prompt_token_ids": token_ids}
        self.check_context(len(prompt), params, "prompt")
        return {"prompt_token_ids": prompt}

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        finals: list[RequestOutput | None],
    ) -> CompletionResponse:
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, final in enumerate(finals):
            if final is None:
                continue
            prompt_tokens += len(final.prompt_token_ids)
            prompt_text = self._prompt_text(final) if request.echo else ""
            for out in final.outputs:
                completion_tokens += len(out.token_ids)
                logprobs = None
                if request.logprobs is not None and out.logprobs is not None:
                    ids, steps = list(out.token_ids), list(out.logprobs)
                    offset = len(prompt_text)
                    if request.echo:
                        ids, steps = _echo_logprobs(final, ids, steps)
                        offset = 0
                    logprobs = completion_logprobs(
                        ids, steps, self.tokenizer, offset, self.token_ids_as_text(request)
                    )
                choices.append(
                    CompletionResponseChoice(
                        index=i * request.n + out.index,
                        text=prompt_text + out.text,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                )
        choices.sort(key=lambda c: c.index)
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return CompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
        )

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer else ""

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        streams: list[Generator],
    ) -> AsyncIterator[str]:
        n = request.n
        offsets: dict[int, int] = {}  # choice index -> characters sent (logprobs text_offset)
        finished: set[int] = set()
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        generated: dict[int, int] = {}  # choice index -> tokens generated so far
        options = request.stream_options
        continuous = bool(options and options.include_usage and options.continuous_usage_stats)

        def usage_so_far(i: int, index: int) -> UsageInfo | None:
            # vLLM's continuous_usage_stats: each chunk carries its choice's usage so far.
            if not continuous:
                return None
            prompt, done = prompt_tokens[i], generated.get(index, 0)
            return UsageInfo(
                prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done
            )

        try:
            async for i, output in merge_streams(streams):
                prompt_tokens[i] = len(output.prompt_token_ids)
                for out in output.outputs:
                    index = i * n + out.index
                    if index in finished:
                        continue
                    text = out.text
                    echoing = request.echo and index not in offsets
                    if echoing:
                        text = self._prompt_text(output) + text
                    if not text and not out.token_ids and out.finish_reason is None:
                        continue
                    completion_tokens += len(out.token_ids)
                    generated[index] = generated.get(index, 0) + len(out.token_ids)
                    logprobs = None
                    if request.logprobs is not None and out.logprobs is not None:
                        start = offsets.get(index, 0) + len(text) - len(out.text)
                        ids, steps = list(out.token_ids), list(out.logprobs)
                        if echoing:
                            ids, steps = _echo_logprobs(output, ids, steps)
                            start = 0
                        logprobs = completion_logprobs(
                            ids, steps, self.tokenizer, start, self.token_ids_as_text(request)
                        )
                    offsets[index] = offsets.get(index, 0) + len(text)
                    if out.finish_reason is not None:
                        finished.add(index)
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=self.model_name,
                        usage=usage_so_far(i, index),
                        choices=[
                            CompletionResponseChoice(
                                index=index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=out.finish_reason,
                                stop_reason=out.stop_reason,
                            )
                        ],
                    )
                    yield sse(chunk)
            if request.stream_options is not None and request.stream_options.include_usage:
                total_prompt = sum(prompt_tokens.values())
                usage = UsageInfo(
                    prompt_tokens=total_prompt,
                    completion_tokens=completion_tokens,
                    total_tokens=total_prompt + completion_tokens,
                )
                yield sse(
                    CompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=self.model_name,
                        choices=[],
                        usage=usage,
                    )
                )
        except Exception as exc:  # after the headers: report it in the stream, as vLLM does
            yield sse(error_body(exc))
        yield sse("[DONE]")


async def _chain(first: RequestOutput | None, rest: Generator) -> Generator:
    if first is not None:
        yield first
        if first.finished:
            await rest.aclose()
            return
    async for output in rest:
        yield output


async def start_all(
    raw_request: Request,
    generators: list[Generator],
    prompt_limit: int | None = None,
    param: str = "prompt",
) -> tuple[list[tuple[RequestOutput | None, Generator]], JSONResponse | None]:
    """The first output of every request, or a 400 if the engine refused one of them (then
    the others are aborted). A prompt longer than `prompt_limit` (which the scheduler
    ignores) is a 400 too, with vLLM's message."""

    async def start() -> list[Any]:
        return await asyncio.gather(*(first_output(g) for g in generators), return_exceptions=True)

    results = await until_disconnected(raw_request, start())
    errors = [r for r in results if isinstance(r, BaseException)]
    for result in results:
        first = None if isinstance(result, BaseException) else result[0]
        if (
            prompt_limit is not None
            and first is not None
            and first.finished
            and len(first.prompt_token_ids) > prompt_limit
            and not any(o.token_ids for o in first.outputs)
        ):
            errors.append(
                ParameterError(
                    f"This model's maximum context length is {prompt_limit} tokens. However, "
                    f"you requested {len(first.prompt_token_ids)} tokens in the {param}. "
                    f"Please reduce the length of the {param}.",
                    param,
                )
            )
    if not errors:
        return results, None
    for gen in generators:
        await gen.aclose()
    for exc in errors:
        if not is_client_error(exc):
            if isinstance(exc, AsyncEngineDeadError):
                raise exc  # the app's handler answers it (500)
            return [], server_error(exc)  # e.g. the request failed inside a stage
    return [], bad_request(errors[0])
