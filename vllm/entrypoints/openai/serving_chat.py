"""POST /v1/chat/completions: the tokenizer's chat template makes the prompt (as `LLM.chat`
does, so greedy replies are the same), then one engine request with `n` choices, streamed as
`chat.completion.chunk` events or returned whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ParameterError,
    ToolCall,
    UsageInfo,
    prompt_logprobs_json,
    random_uuid,
)
from vllm.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from vllm.entrypoints.openai.serving_completion import (
    _chain,
    start_all,
    token_text,
)
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    bad_request,
    check_structured_outputs,
    error_body,
    final_output,
    sse,
)
from vllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from vllm.entrypoints.openai.tool_streaming import ToolCallStreamer
from vllm.entrypoints.openai.tools import (
    forced_tool_calls,
    messages_for_template,
    required_calls,
    tool_choice_mode,
    tool_schema,
)
from vllm.outputs import RequestOutput
from vllm.sequence import Logprob

# Message keys a chat template may read besides role and content (tool calling).
_MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id")


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


def chat_prompt(tokenizer: Any, request: Any, chat_template: str | None = None) -> str:
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
        item = {"role": role, "content": content}
        item.update({k: message[k] for k in _MESSAGE_KEYS if message.get(k) is not None})
        messages.append(item)
    messages = messages_for_template(messages)
    template = getattr(request, "chat_template", None) or chat_template
    extra = dict(getattr(request, "chat_template_kwargs", None) or {})
    tools = getattr(request, "tools", None)
    if tools:  # as vLLM: the template sees the tools even with tool_choice "none"
        extra["tools"] = tools
    effort = getattr(request, "reasoning_effort", None)
    if effort is not None:  # as vLLM: a template that knows it (gpt-oss's) reads it
        extra.setdefault("reasoning_effort", effort)
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=getattr(request, "continue_final_message", False),
            chat_template=template,
            **extra,
        )
    except Exception as exc:  # no template, a template error or its time budget: a 400
        raise ParameterError(f"cannot apply the chat template: {exc}", "messages") from exc


UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


async def render_chat(
    work: BoundedWork, request: Any, chat_template: str | None
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
        special = bool(getattr(request, "add_special_tokens", False))
        return prompt, work.encode_sync(prompt, special, "messages")

    return await work.run(render)


def chat_logprobs(
    token_ids: list[int],
    steps: list[dict[int, Logprob]],
    tokenizer: Any,
    top: int,
    as_id: bool = False,
) -> ChatCompletionLogProbs:
    """The chat logprobs of some tokens (`token_id:N` tokens with `as_id`)."""
    content = []
    for token_id, step in zip(token_ids, steps):
        chosen = step.get(token_id)
        token = token_text(chosen, token_id, tokenizer, as_id)
        ranked = sorted(step.items(), key=lambda kv: kv[1].rank if kv[1].rank else 1 << 30)
        content.append(
            ChatLogProbsContent(
                token=token,
                logprob=max(chosen.logprob, -9999.0) if chosen is not None else -9999.0,
                bytes=list(token.encode("utf-8", errors="replace")),
                top_logprobs=[
                    ChatLogProb(
                        token=(t := token_text(lp, tid, tokenizer, as_id)),
                        logprob=max(lp.logprob, -9999.0),
                        bytes=list(t.encode("utf-8", errors="replace")),
                    )
                    for tid, lp in ranked[:top]
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)


def reply_role(request: ChatCompletionRequest, response_role: str) -> str:
    """The reply's role (vLLM's get_chat_request_role): the server's response role after a
    generation prompt, else the last message's (the model continues that message)."""
    if request.add_generation_prompt or not request.messages:
        return response_role
    role = request.messages[-1].get("role")
    return role if isinstance(role, str) else response_role


def echoed_content(request: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat `echo`: the last message's content, put before the reply when that message
    has the reply's role (the reply continues it); "" otherwise."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    if last.get("role") != role:
        return ""
    return _text_content(last.get("content"))


class OpenAIServingChat(OpenAIServing):
    """Handles /v1/chat/completions. vLLM 0.5.5's constructor: `(engine, model_config,
    served_model_names, response_role, *, lora_modules, prompt_adapters, request_logger,
    chat_template, return_tokens_as_token_ids, enable_auto_tools, tool_parser)`."""

    def __init__(
        self,
        engine: Any,
        model_config: Any = None,
        served_model_names: list[str] | None = None,
        response_role: str = "assistant",
        *,
        chat_template: str | None = None,
        enable_auto_tools: bool = False,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(engine, model_config, served_model_names, **kwargs)
        self.response_role = response_role
        # A path is read (vLLM's load_chat_template), text is the template itself.
        from vllm.entrypoints.chat_utils import load_chat_template

        self.chat_template = load_chat_template(chat_template)
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser: ToolParser | None = None
        if tool_parser is not None:
            self.tool_parser = ToolParserManager.get_tool_parser(tool_parser)(self.tokenizer)
        self.reasoning: ReasoningParser | None = None
        if reasoning_parser is not None:
            self.reasoning = get_reasoning_parser(reasoning_parser)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Any:
        error = self.check_model(request.model)
        if error is not None:
            return error
        try:
            mode, name = tool_choice_mode(
                request, self.enable_auto_tools, self.tool_parser is not None
            )
            params = request.to_sampling_params(tool_schema(request, mode, name))
            prompt, token_ids = await render_chat(self.work, request, self.chat_template)
            self.check_context(len(token_ids), params, "messages")
        except ValueError as exc:
            return bad_request(exc)
        error = await check_structured_outputs(self.engine, params, request.structured_param)
        if error is not None:
            return error
        tools = _ToolMode(
            mode, name, self.tool_parser if mode == "auto" else None, request, self.reasoning
        )
        request_id = f"chat-{random_uuid()}"
        created = int(time.time())
        engine_input = {"prompt": prompt, "prompt_token_ids": token_ids}
        self.log_inputs(request_id, engine_input, params)
        generator = self.engine.generate(
            engine_input, params, request_id, lora_request=self.lora_request(request.model)
        )
        firsts, error = await start_all(raw_request, [generator], self.prompt_limit, "messages")
        if error is not None:
            return error
        stream = _chain(*firsts[0])
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, created, stream, tools, len(token_ids)),
                media_type="text/event-stream",
            )

        final: RequestOutput = await final_output(raw_request, stream)
        body = self._response(request, request_id, created, final, tools)
        return JSONResponse(body.model_dump())

    def _logprobs(self, request: ChatCompletionRequest, out: Any) -> Any:
        if not request.logprobs or out.logprobs is None:
            return None
        return chat_logprobs(
            out.token_ids,
            out.logprobs,
            self.tokenizer,
            request.top_logprobs or 0,
            self.token_ids_as_text(request),
        )

    def _response(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        final: RequestOutput,
        tools: _ToolMode,
    ) -> ChatCompletionResponse:
        choices = []
        role = reply_role(request, self.response_role)
        echo = echoed_content(request, role)
        for out in final.outputs:
            reasoning, content, calls, finish = tools.split(out.text, out.finish_reason)
            if echo:
                content = echo + (content or "")
            choices.append(
                ChatCompletionResponseChoice(
                    index=out.index,
                    message=ChatMessage(
                        role=role,
                        content=content,
                        reasoning_content=reasoning,
                        tool_calls=calls,
                    ),
                    logprobs=self._logprobs(request, out),
                    finish_reason=finish,
                    stop_reason=out.stop_reason,
                )
            )
        choices.sort(key=lambda c: c.index)
        prompt_tokens = len(final.prompt_token_ids)
        completion_tokens = sum(len(out.token_ids) for out in final.outputs)
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage,
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        stream: Any,
        tools: _ToolMode,
        num_prompt_tokens: int = 0,
    ) -> AsyncIterator[str]:
        options = request.stream_options
        continuous = bool(options and options.include_usage and options.continuous_usage_stats)

        def chunk(index: int, delta: DeltaMessage, **extra: Any) -> str:
            choice = ChatCompletionResponseStreamChoice(index=index, delta=delta, **extra)
            usage = None
            if continuous:  # vLLM's continuous_usage_stats: the usage so far in every chunk
                usage = UsageInfo(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens,
                )
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.model_name,
                    choices=[choice],
                    usage=usage,
                )
            )

        prompt_tokens, completion_tokens = num_prompt_tokens, 0

        # vLLM's first chunk per choice carries the role only; with `echo`, the echoed
        # content follows it.
        role = reply_role(request, self.response_role)
        echo = echoed_content(request, role)
        for index in range(request.n):
            yield chunk(index, DeltaMessage(role=role, content=""))
            if echo:
                yield chunk(index, DeltaMessage(content=echo))
        finished: set[int] = set()
        texts: dict[int, str] = {}  # each choice's whole text so far
        streamed: dict[int, int] = {}  # characters of its content already sent
        streamed_r: dict[int, int] = {}  # characters of its reasoning already sent
        named_ids: dict[int, str] = {}  # the tool-call id of each choice (named tool_choice)
        streamers: dict[int, ToolCallStreamer] = {}  # each choice's calls sent so far
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
                    if not tools.active:
                        yield chunk(
                            out.index,
                            DeltaMessage(content=out.text),
                            logprobs=self._logprobs(request, out),
                            finish_reason=out.finish_reason,
                            stop_reason=out.stop_reason,
                        )
                        continue
                    text = texts[out.index] = texts.get(out.index, "") + out.text
                    sent = streamed.get(out.index, 0)
                    sent_r = streamed_r.get(out.index, 0)
                    final = out.finish_reason is not None
                    reasoning, content, calls, finish = tools.split(text, out.finish_reason, final)
                    if reasoning is not None and len(reasoning) > sent_r:
                        streamed_r[out.index] = len(reasoning)
                        yield chunk(out.index, DeltaMessage(reasoning_content=reasoning[sent_r:]))
                    if tools.mode == "named":
                        # The output is the arguments JSON itself: stream it as they grow,
                        # after a first delta naming the function (vLLM's named streaming).
                        arguments = tools.split(text, None, final=False)[1] or ""
                        delta_args = arguments[sent:]
                        if delta_args or (final and out.index not in named_ids):
                            first = out.index not in named_ids
                            call_id = named_ids.setdefault(out.index, ToolCall.new_id())
                            streamed[out.index] = len(arguments)
                            yield chunk(
                                out.index,
                                DeltaMessage(
                                    tool_calls=[
                                        DeltaToolCall(
                                            index=0,
                                            id=call_id if first else None,
                                            type="function" if first else None,
                                            function=DeltaFunctionCall(
                                                name=tools.name if first else None,
                                                arguments=delta_args,
                                            ),
                                        )
                                    ]
                                ),
                            )
                        if final:
                            _, _, _, finish = tools.split(text, out.finish_reason)
                            yield chunk(
                                out.index,
                                DeltaMessage(content=""),
                                finish_reason=finish,
                                stop_reason=out.stop_reason,
                            )
                        continue
                    streamer = streamers.setdefault(out.index, ToolCallStreamer())
                    if not final:
                        # Content streams until it may be opening a tool call; once calls
                        # begin (a JSON format, or a required choice's list), the content
                        # before them goes out, then each call's name and its arguments as
                        # they are generated. Other formats hold the rest to the end.
                        partial = tools.partial_calls(content or "")
                        if partial is not None:
                            begin, found = partial
                            if begin > sent:
                                streamed[out.index] = begin
                                yield chunk(out.index, DeltaMessage(content=content[sent:begin]))
                            deltas = streamer.deltas(found)
                            if deltas:
                                yield chunk(out.index, DeltaMessage(tool_calls=deltas))
                        elif tools.streams_content(content or ""):
                            streamed[out.index] = len(content or "")
                            if content and len(content) > sent:
                                yield chunk(out.index, DeltaMessage(content=content[sent:]))
                        continue
                    if content is not None and len(content) > sent:
                        yield chunk(out.index, DeltaMessage(content=content[sent:]))
                    if calls:
                        deltas = streamer.finish(calls)
                        if deltas:
                            yield chunk(out.index, DeltaMessage(tool_calls=deltas))
                    yield chunk(
                        out.index,
                        DeltaMessage(content=""),
                        finish_reason=finish,
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


class _ToolMode:
    """How one request's choices turn into a message: the reasoning parser's split (if any),
    then plain content (`none`), the tool parser's reading (`auto`), or the tool calls of an
    output the schema forced (`required`, named)."""

    def __init__(
        self,
        mode: str,
        name: str | None,
        parser: ToolParser | None,
        request: Any,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.mode = mode
        self.name = name
        self.parser = parser
        self.request = request
        self.reasoning = reasoning

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def active(self) -> bool:
        return self.forced or self.parser is not None or self.reasoning is not None

    def streams_content(self, content: str) -> bool:
        """Whether content so far may be sent before the choice ends."""
        if self.forced:
            return False
        return self.parser is None or not self.parser.may_start_tool_call(content)

    def partial_calls(self, content: str) -> tuple[int, list[tuple[str | None, str]]] | None:
        """(where the calls begin in `content`, (name, arguments so far) of each) while the
        output grows; None when nothing can be sent as a call yet."""
        if self.mode == "required":
            begin, found = 0, required_calls(content)
        elif self.parser is not None:
            partial = self.parser.partial_calls(content)
            if partial is None:
                return None
            begin, found = partial
        else:
            return None
        if getattr(self.request, "parallel_tool_calls", None) is False:
            found = found[:1]
        return begin, [(call.name, call.arguments) for call in found]

    def split(
        self, text: str, finish_reason: str | None, final: bool = True
    ) -> tuple[str | None, str | None, list[ToolCall], str | None]:
        """(reasoning, content, tool calls, finish_reason) of a choice's text; before its end
        (`final` False) the calls are not read yet."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text, final)
        if not final:
            return reasoning, text, [], finish_reason
        if self.forced:
            calls = forced_tool_calls(text, self.mode, self.name)
            if self.mode == "named":
                # The output is the call's arguments, whole or cut by max_tokens (then
                # truncated, finish_reason "length": vLLM's and OpenAI's answer).
                return reasoning, None, calls, finish_reason
            if finish_reason == "length":  # cut: the calls so far, as a stream sent them
                return reasoning, None, calls, finish_reason
            if not calls:
                return reasoning, text, [], finish_reason
            # vLLM: a named choice finishes with "stop", a required one with "tool_calls".
            return reasoning, None, calls, "tool_calls"
        if self.parser is not None:
            info = self.parser.extract_tool_calls(text, self.request)
            if info.tools_called:
                calls = info.tool_calls
                if getattr(self.request, "parallel_tool_calls", None) is False:
                    calls = calls[:1]  # OpenAI: at most one call per turn
                return reasoning, info.content, calls, "tool_calls"
        return reasoning, text, [], finish_reason
