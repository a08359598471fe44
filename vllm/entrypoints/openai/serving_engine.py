"""What the completion and chat handlers share: the model name check, OpenAI error bodies
(400 naming the parameter), running a request until it finishes or its client goes away,
and server-sent events."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.openai.bounded_work import BoundedWork, ServerLimits
from vllm.entrypoints.openai.protocol import ErrorResponse, ModelCard, ModelList, ParameterError
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

# The served LoRA adapter a request named (set by check_model, in the request's own task):
# its responses carry the adapter's name as their `model`.
_REQUEST_ADAPTER: ContextVar[str | None] = ContextVar("request_adapter", default=None)
_PARAM_NAMES = set(SamplingParams.__dataclass_fields__) | {"max_completion_tokens", "messages"}
# Engine messages that do not start with the parameter's name.
_MESSAGE_PARAMS = [
    (re.compile(r"^Requested sample logprobs"), "logprobs"),
    (re.compile(r"^Requested prompt logprobs"), "prompt_logprobs"),
    (re.compile(r"out of vocabulary|^Prompt cannot be empty|^prompt"), "prompt"),
    (re.compile(r"^best_of"), "best_of"),
]


class ClientDisconnected(Exception):
    """The HTTP client went away before its request finished (the request was aborted)."""


def error_param(exc: BaseException) -> str | None:
    """The request parameter an error is about (the engine's messages name it first)."""
    if isinstance(exc, ParameterError):
        return exc.param
    if isinstance(getattr(exc, "param", None), str):  # structured_fields.StructuredFieldError
        return exc.param  # type: ignore[attr-defined]
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":,.")
    if first in _PARAM_NAMES:
        return first
    for pattern, param in _MESSAGE_PARAMS:
        if pattern.search(message):
            return param
    return None


def error_response(
    message: str,
    err_type: str = "BadRequestError",
    status: HTTPStatus = HTTPStatus.BAD_REQUEST,
    param: str | None = None,
) -> JSONResponse:
    body = ErrorResponse(message=message, type=err_type, param=param, code=status.value)
    return JSONResponse(body.model_dump(), status_code=status.value)


def bad_request(exc: BaseException) -> JSONResponse:
    return error_response(str(exc), param=error_param(exc))


def is_client_error(exc: BaseException) -> bool:
    """A request the client can fix (400); anything else is the server's failure (500)."""
    return isinstance(exc, (ValueError, TypeError))


def error_body(exc: BaseException) -> ErrorResponse:
    """The error object for `exc`, sent inside a stream that has already started: vLLM's
    BadRequestError (400) for a bad request, InternalServerError (500) for a server failure
    (an engine shut down or dead, a request that failed inside a stage)."""
    if is_client_error(exc):
        return ErrorResponse(
            message=str(exc), type="BadRequestError", param=error_param(exc), code=400
        )
    return ErrorResponse(message=str(exc), type="InternalServerError", code=500)


def server_error(exc: BaseException) -> JSONResponse:
    return error_response(
        str(exc), err_type="InternalServerError", status=HTTPStatus.INTERNAL_SERVER_ERROR
    )


@dataclass
class LoRAModulePath:
    """vLLM 0.5's `--lora-modules` entry for the serving constructors: a served adapter name
    and its PEFT directory."""

    name: str
    path: str
    base_model_name: str | None = None


class OpenAIServing:
    """Base of the completion and chat handlers.

    Takes vLLM 0.5's constructor, `(engine, model_config, served_model_names, *,
    lora_modules, prompt_adapters, request_logger, return_tokens_as_token_ids)`, as well as
    the shorter `(engine, served_model_names, work=..., lora_requests=...)` this server uses."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_config: Any = None,
        served_model_names: list[str] | None = None,
        *,
        work: BoundedWork | None = None,
        lora_modules: list[Any] | None = None,
        prompt_adapters: list[Any] | None = None,
        request_logger: Any = None,
        return_tokens_as_token_ids: bool = False,
        lora_requests: list[LoRARequest] | None = None,
        served_loras: dict[str, LoRARequest] | None = None,
    ) -> None:
        if isinstance(model_config, (list, tuple)):  # (engine, served_model_names, ...)
            model_config, served_model_names = None, list(model_config)
        if prompt_adapters:
            raise ValueError("prompt_adapters are not supported by this server.")
        # vLLM 0.5's LoRAModulePath(name, path) entries become requests numbered from 1.
        lora_requests = list(lora_requests or [])
        for module in lora_modules or []:
            if not isinstance(getattr(module, "name", None), str) or not isinstance(
                getattr(module, "path", None), str
            ):
                raise ValueError(
                    f"lora_modules must hold LoRAModulePath(name, path) entries, got {module!r}."
                )
            request = LoRARequest(module.name, len(lora_requests) + 1, module.path)
            request.base_model_name = getattr(module, "base_model_name", None)
            lora_requests.append(request)
        self.engine = engine
        self.model_config = model_config or engine.engine.model_config
        self.served_model_names = served_model_names or [engine.engine.served_model_name]
        self.request_logger = request_logger
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        # Adapter name -> its request (the request's `model` picks it): --lora-modules, or
        # `served_loras`, the server's live map (OpenAIServingModels), kept as is (not copied)
        # so that adapters loaded and unloaded at run time are seen at once.
        if served_loras is not None:
            served_loras.update({r.lora_name: r for r in lora_requests})
            self.loras = served_loras
        else:
            self.loras = {r.lora_name: r for r in lora_requests}
        self.max_model_len = engine.engine.scheduler_config.max_model_len
        # Longer prompts are ignored by the scheduler; the server refuses them with a 400.
        self.prompt_limit = engine.engine.scheduler.prompt_limit
        self.tokenizer = engine.engine.get_tokenizer()
        self.work = work or BoundedWork(self.tokenizer, self.max_model_len, ServerLimits())
        self.limits = self.work.limits

    def log_inputs(self, request_id: str, engine_input: dict[str, Any], params: Any) -> None:
        """Hand a request's inputs to the `request_logger` given to the constructor (if any)."""
        if self.request_logger is not None:
            self.request_logger.log_inputs(
                request_id,
                engine_input.get("prompt"),
                engine_input.get("prompt_token_ids"),
                params,
            )

    @property
    def async_engine_client(self) -> AsyncLLMEngine:
        """vLLM 0.5.5's name for the engine."""
        return self.engine

    def token_ids_as_text(self, request: Any) -> bool:
        """Logprob tokens named 'token_id:N': the server's flag, or the request's own
        `return_tokens_as_token_ids` (vLLM's per-request extra)."""
        return self.return_tokens_as_token_ids or bool(
            getattr(request, "return_tokens_as_token_ids", None)
        )

    def check_context(self, num_prompt_tokens: int, params: SamplingParams, param: str) -> None:
        """Refuse (400, vLLM's and OpenAI's messages) a prompt that does not fit the context,
        or a max_tokens / min_tokens that the context cannot hold after the prompt."""
        truncate = params.truncate_prompt_tokens
        if truncate is not None:
            if truncate > self.max_model_len:
                raise ParameterError(
                    f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len "
                    f"({self.max_model_len}). Please, select a smaller truncation size.",
                    "truncate_prompt_tokens",
                )
            num_prompt_tokens = min(num_prompt_tokens, truncate)
        if num_prompt_tokens > self.prompt_limit:
            raise ParameterError(
                f"This model's maximum context length is {self.prompt_limit} tokens. However, "
                f"you requested {num_prompt_tokens} tokens in the {param}. "
                f"Please reduce the length of the {param}.",
                param,
            )
        room = self.max_model_len - num_prompt_tokens
        for name, value in (("max_tokens", params.max_tokens), ("min_tokens", params.min_tokens)):
            if value is not None and value > room:
                what = "'max_tokens' or 'max_completion_tokens'" if name == "max_tokens" else name
                raise ParameterError(
                    f"{what} is too large: {value}. This model's maximum context length is "
                    f"{self.max_model_len} tokens and your request has {num_prompt_tokens} "
                    f"input tokens ({value} > {self.max_model_len} - {num_prompt_tokens}).",
                    name,
                )

    def show_models(self) -> ModelList:
        # vLLM 0.5 reports the first served name as every card's root (a GGUF file's path,
        # or a temporary directory, is no name a client can use).
        root = self.served_model_names[0]
        return ModelList(
            data=[
                ModelCard(id=name, root=root, max_model_len=self.max_model_len)
                for name in self.served_model_names
            ]
            + [
                ModelCard(
                    id=lora.lora_name,
                    root=lora.lora_path,
                    parent=lora.base_model_name or self.served_model_names[0],
                )
                for lora in self.loras.values()
            ]
        )

    async def show_available_models(self) -> ModelList:
        """vLLM's name for `show_models`."""
        return self.show_models()

    def check_model(self, model: str | None) -> JSONResponse | None:
        """None if the request's model is served (or not given), else a 404 body. A served
        adapter's name is remembered for the request's responses (`model_name`)."""
        _REQUEST_ADAPTER.set(model if model in self.loras else None)
        if model is None or model in self.served_model_names or model in self.loras:
            return None
        return error_response(
            f"The model `{model}` does not exist.",
            err_type="NotFoundError",
            status=HTTPStatus.NOT_FOUND,
            param="model",
        )

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        return self.loras.get(model) if model else None

    @property
    def model_name(self) -> str:
        """The `model` of this request's responses: the adapter it named, else the base."""
        return _REQUEST_ADAPTER.get() or self.served_model_names[0]


async def first_output(
    generator: AsyncGenerator[RequestOutput, None],
) -> tuple[RequestOutput | None, AsyncGenerator[RequestOutput, None]]:
    """Wait for a request's first output, so a bad request fails before any response byte
    is sent (the engine validates it); None if the stream ended without one (aborted)."""
    try:
        first = await generator.__anext__()
    except StopAsyncIteration:
        return None, generator
    return first, generator


async def merge_streams(
    generators: list[AsyncGenerator[RequestOutput, None]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come: (index of the generator, output)."""
    if len(generators) == 1:
        async for output in generators[0]:
            yield 0, output
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for output in gen:
                await queue.put((i, output))
            await queue.put(done)
        except Exception as exc:  # handed to the consumer
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generators)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # each generate() aborts its request when cancelled


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (its body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_output(request: Request, stream: Any) -> Any:
    """The last output of a request's stream (its final RequestOutput), aborted if the client
    leaves first."""

    async def collect() -> Any:
        final = None
        async for output in stream:
            final = output
        return final

    final = await until_disconnected(request, collect())
    assert final is not None
    return final


async def until_disconnected(request: Request, coro: Any) -> Any:
    """Await `coro`, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnected()


def sse(data: Any) -> str:
    """One server-sent event (`data` is a pydantic model or the string [DONE])."""
    if isinstance(data, str):
        return f"data: {data}\n\n"
    return f"data: {json.dumps(data.model_dump(exclude_unset=False))}\n\n"


async def check_structured_outputs(engine: Any, params: Any, param: str) -> Any:
    """Compile the request's grammar (cached per spec) off the event loop: a schema, regex or
    grammar the backend refuses is a 400 naming the field that carried it; else None."""
    if params.structured_outputs is None:
        return None
    try:
        await asyncio.to_thread(engine.engine.check_structured_outputs, params)
    except ValueError as exc:
        return bad_request(ParameterError(str(exc), param))
    return None
