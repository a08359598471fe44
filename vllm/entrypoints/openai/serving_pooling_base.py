"""What the pooling handlers (embeddings, pooling, score, rerank, classify) share: the inputs
tokenized off the event loop and checked against the context, one `encode` per input run
together, a refused input failing the whole request with a 400 (the others aborted), and the
usage of the finished outputs.

A pooling request runs its prompt once through every stage and finishes: its one output is
its final output, so the handlers wait for all of them and answer once (no streaming).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm.engine.async_llm_engine import AsyncEngineDeadError
from vllm.entrypoints.openai.protocol import ParameterError, UsageInfo
from vllm.entrypoints.openai.protocol_pooling import EmbeddingChatRequest
from vllm.entrypoints.openai.serving_chat import render_chat
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    bad_request,
    error_param,
    is_client_error,
    server_error,
    until_disconnected,
)
from vllm.inputs import is_token_list

# vLLM's answer when a route's task is not one the served model runs.
UNSUPPORTED_API = "The model does not support {api} API"
_POOLING_FIELDS = (
    "truncate_prompt_tokens",
    "dimensions",
    "normalize",
    "use_activation",
    "activation",
    "softmax",
    "priority",
)
# PoolingParams' messages that do not start with the parameter's name.
_UNSUPPORTED_PARAMS = re.compile(r"does not support \['(\w+)'")


def pooling_bad_request(exc: BaseException) -> JSONResponse:
    """A 400 for a refused pooling request, naming the parameter PoolingParams' message is
    about (vLLM's messages: "Dimensions must be greater than 0", "Task embed only supports
    [...] parameters, does not support ['use_activation'] parameters")."""
    if error_param(exc) is None:
        message = str(exc)
        first = message.split(" ", 1)[0].rstrip(":,.")
        found = _UNSUPPORTED_PARAMS.search(message)
        param = None
        if first in _POOLING_FIELDS:
            param = first
        elif found is not None:
            param = found.group(1)
        elif "matryoshka" in message or message.startswith("Dimensions"):
            param = "dimensions"
        if param is not None:
            exc = ParameterError(message, param)
    return bad_request(exc)


def prompt_list(value: Any, param: str) -> list[str | list[int]]:
    """A request's inputs: a string, a list of strings, token ids or lists of token ids."""
    if isinstance(value, str):
        return [value]
    if is_token_list(value):
        return [list(value)]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or all(is_token_list(p) for p in value):
            return list(value)
    raise ParameterError(
        f"{param} must be a string, a list of strings, a list of token ids or a list of "
        "such lists, and not empty.",
        param,
    )


def usage_of(outputs: Sequence[Any]) -> UsageInfo:
    """Pooling usage: every prompt token counts, nothing is generated."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens, completion_tokens=0)


class PoolingServing(OpenAIServing):
    """Base of the pooling handlers. `task` is the PoolingParams task the handler sets on
    its requests, `api` the name its refusal uses when the served model does not run it."""

    task = "embed"
    api = "Embeddings"

    # -- the served model ----------------------------------------------------------------

    def unsupported(self, task: str | None = None, api: str | None = None) -> JSONResponse | None:
        """vLLM's 400 when the served model does not run `task` (a generative model here)."""
        if (task or self.task) in supported_pooling_tasks(self.model_config):
            return None
        return bad_request(ValueError(UNSUPPORTED_API.format(api=api or self.api)))

    def check_priority(self, priority: int) -> None:
        if priority != 0:
            raise ParameterError(
                f"Got priority {priority} but Priority scheduling is not enabled.", "priority"
            )

    # -- inputs ----------------------------------------------------------------------------

    def effective_truncation(self, truncate: int | None) -> int | None:
        """`truncate_prompt_tokens`: -1 is the model's context, more than it is refused."""
        if truncate is None:
            return None
        if truncate < 0:
            return self.max_model_len
        if truncate > self.max_model_len:
            raise ParameterError(
                f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len "
                f"({self.max_model_len}). Please, select a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        return truncate

    def check_length(self, num_tokens: int, truncate: int | None, param: str) -> None:
        """vLLM's message for an input longer than the context (after truncation)."""
        if truncate is not None:
            num_tokens = min(num_tokens, truncate)
        if num_tokens > self.prompt_limit:
            raise ParameterError(
                f"This model's maximum context length is {self.prompt_limit} tokens. However, "
                f"you requested {num_tokens} tokens in the input for embedding generation. "
                "Please reduce the length of the input.",
                param,
            )

    def check_count(self, count: int, param: str) -> None:
        limit = self.limits.max_prompts_per_request
        if count > limit:
            raise ParameterError(
                f"{param} holds {count} inputs; this server takes at most {limit} per request "
                "(--max-prompts-per-request).",
                param,
            )

    async def engine_inputs(
        self,
        prompts: Sequence[str | list[int]],
        add_special_tokens: bool,
        truncate: int | None,
        param: str = "input",
    ) -> list[dict[str, Any]]:
        """Each prompt as the engine takes it, tokenized in the bounded-work pool, its last
        `truncate` tokens kept (vLLM's left truncation) and checked against the context."""
        self.check_count(len(prompts), param)
        vocab = self.model_config.get_vocab_size()
        inputs = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = await self.work.encode(prompt, add_special_tokens, param)
                item: dict[str, Any] = {"prompt": prompt}
            else:
                bad = [t for t in prompt if not 0 <= t < vocab]
                if bad:
                    raise ParameterError(f"Token id {bad[0]} is out of vocabulary", param)
                ids = list(prompt)
                item = {}
            if not ids:
                raise ParameterError(f"{param} cannot be empty.", param)
            self.check_length(len(ids), truncate, param)
            item["prompt_token_ids"] = ids[-truncate:] if truncate else ids
            inputs.append(item)
        return inputs

    async def chat_input(self, request: Any, truncate: int | None) -> list[dict[str, Any]]:
        """A chat request's messages through the chat template, as one engine input."""
        prompt, ids = await render_chat(self.work, request, getattr(self, "chat_template", None))
        if request.add_special_tokens:  # on top of what the template put in
            ids = await self.work.encode(prompt, True, "messages")
        self.check_length(len(ids), truncate, "messages")
        return [{"prompt": prompt, "prompt_token_ids": ids[-truncate:] if truncate else ids}]

    async def request_inputs(self, request: Any, truncate: int | None) -> list[dict[str, Any]]:
        """The engine inputs of an embeddings or /pooling request: its chat `messages` through
        the template (a chat request: `EmbeddingChatRequest` or its /pooling subclass), else its
        `input` prompts."""
        if isinstance(request, EmbeddingChatRequest):
            return await self.chat_input(request, truncate)
        prompts = prompt_list(request.input, "input")
        return await self.engine_inputs(prompts, request.add_special_tokens, truncate)

    def pooling_params(self, request: Any, task: str | None = None) -> Any:
        """The request's PoolingParams with this handler's task (ValueError: a 400)."""
        params = request.to_pooling_params()
        return dataclasses.replace(params, task=task or self.task)

    # -- running -----------------------------------------------------------------------------

    async def encode_all(
        self,
        raw_request: Request,
        request_id: str,
        inputs: list[dict[str, Any]],
        params: Any,
        model: str | None,
    ) -> list[Any] | JSONResponse:
        """Run every input (`params`: one PoolingParams for all, or one per input) and return
        their final outputs in input order; a 400 if the engine refused one (the others are
        aborted), a 500 if it failed; aborted if the client leaves."""
        lora = self.lora_request(model)
        per_input = params if isinstance(params, list) else [params] * len(inputs)

        async def one(i: int, engine_input: Any) -> Any:
            item_id = f"{request_id}-{i}"
            self.log_inputs(item_id, engine_input, per_input[i])
            final = None
            async for output in self.engine.encode(engine_input, per_input[i], item_id, lora):
                final = output
            if final is None:
                raise RuntimeError(f"request {item_id} ended without an output (aborted)")
            return final

        async def run() -> list[Any]:
            tasks = [asyncio.ensure_future(one(i, x)) for i, x in enumerate(inputs)]
            try:
                return await asyncio.gather(*tasks)
            finally:
                for task in tasks:  # on the first failure the others are aborted
                    task.cancel()

        try:
            return list(await until_disconnected(raw_request, run()))
        except AsyncEngineDeadError:
            raise  # the app's handler answers it (500)
        except Exception as exc:
            if is_client_error(exc):
                return pooling_bad_request(exc)
            return server_error(exc)


def supported_pooling_tasks(model_config: Any) -> tuple[str, ...]:
    """The pooling tasks the served model runs (empty for a generative model)."""
    tasks = getattr(model_config, "supported_tasks", None)
    if tasks is not None:
        return tuple(t for t in tasks if t != "generate")
    return ()
