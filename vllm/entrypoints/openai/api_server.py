"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

    python -m vllm.entrypoints.openai.api_server --model MODEL [engine flags] [--port 8000]
    vllm serve MODEL [engine flags]

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /version, /metrics,
/tokenize, /detokenize. With `--api-key` (or VLLM_API_KEY) the /v1 routes need
`Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

import vllm
from vllm import envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat, chat_prompt
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    bad_request,
    error_response,
)
from vllm.logger import init_logger

logger = init_logger("vllm.entrypoints.openai.api_server")


def build_app(
    engine: AsyncLLMEngine,
    served_model_names: Optional[list[str]] = None,
    api_key: Optional[str] = None,
    chat_template: Optional[str] = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: Optional[str] = None,
    reasoning_parser: Optional[str] = None,
) -> FastAPI:
    """The FastAPI app serving `engine` under `served_model_names` (default: the model)."""
    names = served_model_names or [engine.engine.served_model_name]
    completion = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(
        engine,
        names,
        chat_template=chat_template,
        enable_auto_tools=enable_auto_tool_choice,
        tool_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    tokenizer = completion.tokenizer
    app = FastAPI()
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        param = None
        if errors:
            loc = [str(p) for p in errors[0].get("loc", ()) if p != "body"]
            param = loc[0] if loc else None
        return error_response(str(exc), param=param)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: the client is gone

    @app.exception_handler(AsyncEngineDeadError)
    async def engine_dead(_: Request, exc: AsyncEngineDeadError) -> JSONResponse:
        return error_response(
            str(exc), err_type="InternalServerError", status=HTTPStatus.INTERNAL_SERVER_ERROR
        )

    if api_key:

        @app.middleware("http")
        async def authenticate(request: Request, call_next: Any) -> Any:
            if request.method != "OPTIONS" and request.url.path.startswith("/v1"):
                if request.headers.get("Authorization") != f"Bearer {api_key}":
                    return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except AsyncEngineDeadError as exc:
            return error_response(
                str(exc), err_type="InternalServerError", status=HTTPStatus.INTERNAL_SERVER_ERROR
            )
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": vllm.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    if envs.get_str("VLLM_TORCH_PROFILER_DIR"):
        # As in vLLM: the profiling routes exist only when a trace directory is set.

        @app.post("/start_profile")
        async def start_profile() -> Response:
            logger.info("Starting profiler...")
            await engine.start_profile()
            logger.info("Profiler started.")
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            logger.info("Stopping profiler...")
            await engine.stop_profile()
            logger.info("Profiler stopped.")
            return Response(status_code=200)

    @app.get("/v1/models")
    async def show_models() -> JSONResponse:
        return JSONResponse(completion.show_models().model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Any:
        error = completion.check_model(request.model)
        if error is not None:
            return error
        try:
            if tokenizer is None:
                raise ValueError("tokenize needs a tokenizer (skip_tokenizer_init is set).")
            if request.messages is not None:
                text = chat_prompt(tokenizer, request, chat_template)
                tokens = tokenizer.encode(text, add_special_tokens=False)
            elif request.prompt is not None:
                tokens = tokenizer.encode(
                    request.prompt, add_special_tokens=request.add_special_tokens
                )
            else:
                raise ValueError("prompt or messages must be given.")
        except ValueError as exc:
            return bad_request(exc)
        body = TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=completion.max_model_len
        )
        return JSONResponse(body.model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Any:
        error = completion.check_model(request.model)
        if error is not None:
            return error
        vocab = engine.engine.model_config.get_vocab_size()
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad or tokenizer is None:
            message = f"Token id {bad[0]} is out of vocabulary" if bad else "no tokenizer"
            return error_response(message, param="tokens")
        body = DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
        return JSONResponse(body.model_dump())

    return app


def make_arg_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    """Server flags plus every engine flag (AsyncEngineArgs)."""
    if parser is None:
        parser = argparse.ArgumentParser(description="vLLM OpenAI-compatible API server.")
    parser.add_argument("--host", type=str, default=None, help="Host name (default: all).")
    parser.add_argument("--port", type=int, default=8000, help="Port number.")
    parser.add_argument(
        "--api-key",
        type=str,
        default=None,
        help="If given, /v1 requests must send this key as 'Authorization: Bearer KEY' "
        "(default: env VLLM_API_KEY).",
    )
    parser.add_argument(
        "--chat-template", type=str, default=None, help="A Jinja chat template (file or text)."
    )
    add_tool_args(parser)
    parser.add_argument(
        "--uvicorn-log-level",
        type=str,
        default="info",
        choices=["debug", "info", "warning", "error", "critical", "trace"],
        help="Log level for uvicorn.",
    )
    return AsyncEngineArgs.add_cli_args(parser)


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling flags."""
    from vllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from vllm.entrypoints.openai.tool_parsers import ToolParserManager

    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="Let the model call tools on its own (tool_choice='auto'); needs --tool-call-parser.",
    )
    parser.add_argument(
        "--tool-call-parser",
        type=str,
        default=None,
        choices=sorted(ToolParserManager.tool_parsers),
        help="How tool calls are read from the model's output (the model's format).",
    )
    parser.add_argument(
        "--reasoning-parser",
        type=str,
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="Split a think-tag model's reasoning into `reasoning_content`.",
    )


def _load_chat_template(value: Optional[str]) -> Optional[str]:
    if value is not None and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def build_engine(args: argparse.Namespace) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs.from_cli_args(args))


async def serve(args: argparse.Namespace, engine: Optional[AsyncLLMEngine] = None) -> None:
    """Run the server until it is stopped (Ctrl-C / SIGTERM); shut the engine down after."""
    import uvicorn

    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser to be set")
    engine = engine if engine is not None else build_engine(args)
    api_key = args.api_key or envs.get_str("VLLM_API_KEY") or None
    names = [args.served_model_name] if args.served_model_name else None
    app = build_app(
        engine,
        names,
        api_key,
        _load_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_keep_alive=5
    )
    host = args.host or "0.0.0.0"
    logger.info("Serving %s on http://%s:%d", engine.engine.served_model_name, host, args.port)
    try:
        await uvicorn.Server(config).serve()
    finally:
        engine.shutdown()


def main(argv: Optional[list[str]] = None) -> None:
    args = make_arg_parser().parse_args(argv)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
