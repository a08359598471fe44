"""vLLM's legacy demo server (not the OpenAI API; that is `vllm.entrypoints.openai.api_server`).

    python -m vllm.entrypoints.api_server --model MODEL [engine flags] [--port 8000]

`POST /generate` takes `{"prompt": ..., "stream": false, <SamplingParams fields>}` and answers
`{"text": [prompt + output, ...]}` (one per output); with `"stream": true` each update is such
a JSON object followed by a NUL byte. `GET /health`. A client that leaves aborts its request.
Bad sampling parameters are a 400 with the ValueError's message (vLLM answers 500).

Hardened as the OpenAI server is, with the same pieces: `--api-key` (or VLLM_API_KEY) makes
every route but /health need `Authorization: Bearer KEY` (constant-time check, api_key.py);
`--max-request-body-bytes` refuses a larger body with 413 before it is read; a text prompt is
capped in characters (bounded_work.py: more than the context can hold is a 400 without
tokenizing it) and tokenized in BoundedWork's thread pool, off the event loop and off the
engine thread, so one huge prompt does not stall the other requests. TLS: vLLM's `--ssl-*`
flags (tls.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm import envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.api_key import ApiKeyCheck
from vllm.entrypoints.health import health_response
from vllm.entrypoints.openai.api_server import BodySizeLimit
from vllm.entrypoints.openai.bounded_work import BoundedWork, ServerLimits
from vllm.entrypoints.openai.serving_engine import ClientDisconnected, until_disconnected
from vllm.entrypoints.tls import add_tls_args, scheme, uvicorn_tls_kwargs
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams

logger = init_logger("vllm.entrypoints.api_server")

TIMEOUT_KEEP_ALIVE = 5  # seconds

router = APIRouter()
# The engine /generate uses, set by `init_app` (module globals, as in vLLM's demo).
engine: AsyncLLMEngine | None = None
# Tokenization for /generate (the thread pool and prompt cap of the OpenAI server), made for
# `engine` on first use; `init_app` replaces it with one holding the server's limits.
work: BoundedWork | None = None


def _uuid() -> str:
    import uuid

    return uuid.uuid4().hex


@router.get("/health")
async def health() -> Response:
    """200 while the engine serves (a JSON body when degraded), 503 once it is dead."""
    if engine is None:
        return Response(status_code=200)
    return await health_response(engine)


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=400)


def _work_for(current: AsyncLLMEngine) -> BoundedWork:
    """The module's BoundedWork, made for `current` with the default limits if none is set
    (an app served without `init_app`, as vLLM's own tests do)."""
    global work
    if work is None:
        work = BoundedWork(
            current.engine.get_tokenizer(),
            current.engine.scheduler_config.max_model_len,
            ServerLimits(),
        )
    return work


async def _prompt_input(current: AsyncLLMEngine, prompt: Any) -> Any:
    """The engine input for a text prompt: its token ids, made off the event loop and off
    the engine thread (a ValueError naming `prompt` when it is too long or not Unicode).
    Anything else (a `{"prompt_token_ids": [...]}` dict, as vLLM's demo takes) goes to the
    engine as sent: it has nothing to tokenize, and the engine checks it."""
    max_model_len = current.engine.scheduler_config.max_model_len
    if not isinstance(prompt, str):
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if isinstance(ids, list):
            _check_prompt_len(len(ids), max_model_len)
        return prompt
    bounded = _work_for(current)
    if bounded.tokenizer is None:  # skip_tokenizer_init: the engine takes the text as is
        return prompt
    token_ids = await bounded.encode(prompt, True, "prompt")
    _check_prompt_len(len(token_ids), max_model_len)
    return {"prompt": prompt, "prompt_token_ids": token_ids}


def _check_prompt_len(num_tokens: int, max_model_len: int) -> None:
    """A prompt the context cannot hold is a 400 with the OpenAI server's (vLLM's) message, not
    a request the engine ignores after queueing it."""
    if num_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_tokens} tokens in the prompt. Please reduce the length of the "
            "prompt."
        )


@router.post("/generate")
async def generate(request: Request) -> Response:
    """Generate text for `prompt` with the other fields as SamplingParams."""
    current = engine
    assert current is not None, "init_app() was not called"
    try:
        request_dict = await request.json()
    except ValueError:
        return _bad_request("The body must be a JSON object.")
    if not isinstance(request_dict, dict) or "prompt" not in request_dict:
        return _bad_request("prompt is required.")
    prompt = request_dict.pop("prompt")
    stream = bool(request_dict.pop("stream", False))
    try:
        sampling_params = SamplingParams(**request_dict)
        engine_input = await until_disconnected(request, _prompt_input(current, prompt))
    except ClientDisconnected:
        return Response(status_code=499)
    except (TypeError, ValueError) as exc:
        return _bad_request(str(exc))
    results = current.generate(engine_input, sampling_params, _uuid())

    def texts(output: Any) -> dict[str, list[str]]:
        head = output.prompt or ""
        return {"text": [head + o.text for o in output.outputs]}

    try:
        first = await until_disconnected(request, results.__anext__())
    except StopAsyncIteration:
        return Response(status_code=499)  # aborted before any output
    except ClientDisconnected:
        return Response(status_code=499)
    except (TypeError, ValueError) as exc:  # the engine refused the request
        return _bad_request(str(exc))

    if stream:

        async def stream_results() -> AsyncIterator[bytes]:
            yield (json.dumps(texts(first)) + "\0").encode("utf-8")
            async for output in results:
                yield (json.dumps(texts(output)) + "\0").encode("utf-8")

        return StreamingResponse(stream_results())

    async def final() -> Any:
        last = first
        async for output in results:
            last = output
        return last

    try:
        last = await until_disconnected(request, final())
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(texts(last))


# vLLM's module-level app, for serving in-process after setting `engine` (as vLLM's own demo
# tests do): the routes and the default body limit, no key; `build_app` makes the configured one.
app = FastAPI()
app.include_router(router)
app.add_middleware(BodySizeLimit, max_bytes=ServerLimits().max_request_body_bytes)


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else VLLM_API_KEY (as the OpenAI server reads it)."""
    return getattr(args, "api_key", None) or envs.get_str("VLLM_API_KEY") or None


def build_app(args: argparse.Namespace) -> FastAPI:
    """A new app with the routes, the key check (if a key is set) and the body-size limit."""
    built = FastAPI(root_path=getattr(args, "root_path", None) or "")
    built.include_router(router)
    key = _api_key(args)
    if key:
        check = ApiKeyCheck(key)

        @built.middleware("http")
        async def authenticate(request: Request, call_next: Any) -> Any:
            if request.method != "OPTIONS" and request.url.path != "/health":
                if not check.allows(request.headers.get("Authorization", "")):
                    return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

    # Outermost: a body over the limit is refused before the key check or a handler reads it.
    built.add_middleware(BodySizeLimit, max_bytes=_limits(args).max_request_body_bytes)
    return built


def _limits(args: argparse.Namespace) -> ServerLimits:
    defaults = ServerLimits()
    size = getattr(args, "max_request_body_bytes", None)
    if size is not None and size <= 0:
        raise ValueError(f"--max-request-body-bytes must be positive, got {size}.")
    return ServerLimits(max_request_body_bytes=size or defaults.max_request_body_bytes)


async def init_app(args: argparse.Namespace, llm_engine: AsyncLLMEngine | None = None) -> FastAPI:
    """The app, with `llm_engine` (or one built from the engine flags) behind /generate."""
    global engine, work
    built = build_app(args)
    engine = (
        llm_engine
        if llm_engine is not None
        else AsyncLLMEngine.from_engine_args(AsyncEngineArgs.from_cli_args(args))
    )
    work = BoundedWork(
        engine.engine.get_tokenizer(),
        engine.engine.scheduler_config.max_model_len,
        _limits(args),
    )
    return built


def uvicorn_config(args: argparse.Namespace, served: FastAPI, **uvicorn_kwargs: Any) -> Any:
    """The uvicorn.Config of `served` with the host, port and TLS flags in `args`."""
    import uvicorn

    return uvicorn.Config(
        served,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=TIMEOUT_KEEP_ALIVE,
        **uvicorn_tls_kwargs(args),
        **uvicorn_kwargs,
    )


async def run_server(
    args: argparse.Namespace, llm_engine: AsyncLLMEngine | None = None, **uvicorn_kwargs: Any
) -> None:
    """Serve until SIGINT/SIGTERM, then shut the engine down."""
    import uvicorn

    uvicorn_tls_kwargs(args)  # bad TLS flags fail before the engine loads
    served = await init_app(args, llm_engine)
    config = uvicorn_config(args, served, **uvicorn_kwargs)
    logger.info("Serving /generate on %s://%s:%d", scheme(args), args.host or "0.0.0.0", args.port)
    if not _api_key(args):
        logger.info("No API key (--api-key, VLLM_API_KEY): /generate is open to every client.")
    try:
        await uvicorn.Server(config).serve()
    finally:
        if engine is not None:
            engine.shutdown()
        if work is not None:
            work.shutdown()


def make_arg_parser() -> argparse.ArgumentParser:
    """vLLM's demo-server flags plus every engine flag."""
    parser = argparse.ArgumentParser(description="vLLM demo API server (/generate).")
    parser.add_argument("--host", type=str, default=None)
    parser.add_argument("--port", type=int, default=8000)
    add_tls_args(parser)
    parser.add_argument(
        "--api-key",
        type=str,
        default=None,
        help="If given, every route but /health needs this key as 'Authorization: Bearer KEY' "
        "(default: env VLLM_API_KEY, which keeps it out of ps).",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=ServerLimits().max_request_body_bytes,
        help="Larger request bodies are refused with 413.",
    )
    parser.add_argument(
        "--root-path",
        type=str,
        default=None,
        help="FastAPI root_path when app is behind a path based routing proxy",
    )
    parser.add_argument("--log-level", type=str, default="debug")
    return AsyncEngineArgs.add_cli_args(parser)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(run_server(make_arg_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
