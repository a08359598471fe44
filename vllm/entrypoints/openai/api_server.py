"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

    python -m vllm.entrypoints.openai.api_server --model MODEL [engine flags] [--port 8000]
    vllm serve MODEL [engine flags]

Routes: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /health, /version,
/metrics, /tokenize, /detokenize, /v1/embeddings, /pooling, /classify, /score and /rerank
(pooling_routes.py), /v1/files and /v1/batches (batches.py); with an API key or
VLLM_SERVER_DEV_MODE=1, /v1/admin/* (admin.py: the layer split, changed while serving; 403
otherwise); with VLLM_ALLOW_RUNTIME_LORA_UPDATING, /v1/load_lora_adapter and
/v1/unload_lora_adapter (serving_models.py). TLS: vLLM's --ssl-* flags (tls.py). With
`--api-key` (one or more keys, or VLLM_API_KEY) the /v1 routes need `Authorization: Bearer KEY`
with any of the keys; the request then carries a stable, non-secret id of the key it used
(`request.state.api_key_id`, see `api_key_id`), by which /v1/files and /v1/batches keep each
key's objects apart.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import secrets
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

import vllm
from vllm import envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from vllm.entrypoints.health import health_response
from vllm.entrypoints.openai.admin import DEV_MODE_ENV, mount_admin_routes
from vllm.entrypoints.openai.batch_lines import BatchLineRunner
from vllm.entrypoints.openai.batch_store import FileQuota
from vllm.entrypoints.openai.batches import add_batch_args, attach_batches, file_quota_from_args
from vllm.entrypoints.openai.bounded_work import BoundedWork, ServerLimits
from vllm.entrypoints.openai.lora_modules import add_lora_args, lora_requests
from vllm.entrypoints.openai.pooling_routes import attach_pooling_routes
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm.entrypoints.openai.protocol_responses import ResponsesRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat, render_chat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    bad_request,
    error_response,
)
from vllm.entrypoints.openai.serving_models import OpenAIServingModels, attach_lora_routes
from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm.entrypoints.tls import add_tls_args, scheme, uvicorn_tls_kwargs
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.request_failure import RequestFailedError

logger = init_logger("vllm.entrypoints.openai.api_server")


def build_app(
    engine: AsyncLLMEngine,
    served_model_names: list[str] | None = None,
    api_key: str | Sequence[str] | None = None,
    chat_template: str | None = None,
    limits: ServerLimits | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    batch_state_dir: str | None = None,
    batch_max_concurrency: int | None = None,
    file_quota: FileQuota | None = None,
    return_tokens_as_token_ids: bool = False,
    response_role: str = "assistant",
    lora_requests: list[LoRARequest] | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` under `served_model_names` (default: the model);
    `api_key` is one key or several, any of which a request may present."""
    names = served_model_names or [engine.engine.served_model_name]
    limits = limits or ServerLimits()
    scheduler_config = engine.engine.scheduler_config
    work = BoundedWork(engine.engine.get_tokenizer(), scheduler_config.max_model_len, limits)
    # The served adapters, one map the handlers read and the runtime routes change.
    models = OpenAIServingModels(engine, names, lora_requests)
    completion = OpenAIServingCompletion(
        engine,
        names,
        work=work,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        served_loras=models.lora_requests,
    )
    chat = OpenAIServingChat(
        engine,
        names,
        response_role=response_role,
        work=work,
        served_loras=models.lora_requests,
        chat_template=chat_template,
        enable_auto_tools=enable_auto_tool_choice,
        tool_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
    )
    chat_template = chat.chat_template  # read once (a path or the text)
    responses = OpenAIServingResponses(
        engine,
        names,
        work=work,
        chat_template=chat_template,
        served_loras=models.lora_requests,
    )
    tokenizer = completion.tokenizer
    app = FastAPI()
    app.state.engine = engine
    app.state.work = work
    app.state.models = models
    app.state.draining = False  # set at shutdown: new requests get 503

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
        on_death = getattr(app.state, "on_engine_death", None)
        if on_death is not None:  # vLLM: a request that finds the engine dead stops the server
            on_death()
        return error_response(
            str(exc), err_type="InternalServerError", status=HTTPStatus.INTERNAL_SERVER_ERROR
        )

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(
            str(exc), err_type="InternalServerError", status=HTTPStatus.INTERNAL_SERVER_ERROR
        )

    @app.middleware("http")
    async def refuse_when_draining(request: Request, call_next: Any) -> Any:
        if app.state.draining and request.url.path != "/health":
            return error_response(
                "The server is shutting down.",
                err_type="ServiceUnavailableError",
                status=HTTPStatus.SERVICE_UNAVAILABLE,
            )
        return await call_next(request)

    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if any(not isinstance(k, str) or not k for k in keys):
        raise ValueError("--api-key: every key must be a non-empty string.")
    if keys:
        open_paths = {"/health", "/version"}
        if limits.allow_unauthenticated_metrics:
            open_paths.add("/metrics")
        # Compared as digests: compare_digest needs equal-length inputs to be constant-time.
        wanted = [hashlib.sha256(k.encode()).digest() for k in keys]

        @app.middleware("http")
        async def authenticate(request: Request, call_next: Any) -> Any:
            key_id = _authorized_key_id(request.headers.get("Authorization", ""), wanted)
            request.state.api_key_id = key_id
            if request.method != "OPTIONS" and request.url.path not in open_paths:
                if key_id is None:
                    return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

    # Outermost: a body over the limit is refused before any handler reads it.
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        # 200 healthy or degraded (a stage being replaced), 503 dead: entrypoints/health.py
        return await health_response(engine)

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

    runtime_lora = envs.get_bool("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    if runtime_lora:
        # As in vLLM: the routes exist only when allowed (else 404).
        attach_lora_routes(app, models)

    # /v1/admin/* (admin.py): only with an API key or VLLM_SERVER_DEV_MODE=1, else 403.
    admin = mount_admin_routes(app, engine, api_key_set=bool(keys))
    logger.info(
        "Optional routes: admin (/v1/admin/*) %s; runtime LoRA (/v1/load_lora_adapter) %s; "
        "profiler (/start_profile) %s.",
        "mounted" if admin else f"off (needs an API key or {DEV_MODE_ENV}=1)",
        "mounted" if runtime_lora else "off (VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
        "mounted" if envs.get_str("VLLM_TORCH_PROFILER_DIR") else "off (VLLM_TORCH_PROFILER_DIR)",
    )

    @app.get("/v1/models")
    async def show_models() -> JSONResponse:
        return JSONResponse(completion.show_models().model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Any:
        return await responses.create_response(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Any:
        error = completion.check_model(request.model)
        if error is not None:
            return error
        try:
            if tokenizer is None:
                raise ValueError("tokenize needs a tokenizer (skip_tokenizer_init is set).")
            if request.messages is not None:
                _, tokens = await render_chat(work, request, chat_template)
            elif request.prompt is not None:
                tokens = await work.encode(request.prompt, request.add_special_tokens, "prompt")
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
        text = await work.run(lambda: tokenizer.decode(request.tokens))
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    # /v1/embeddings, /pooling, /classify, /score, /rerank (pooling_routes.py).
    attach_pooling_routes(
        app,
        engine,
        names,
        work=work,
        served_loras=models.lora_requests,
        chat_template=chat_template,
    )

    # /v1/files and /v1/batches (batches.py).
    attach_batches(
        app,
        BatchLineRunner(completion, chat),
        scheduler_config.max_num_seqs,
        batch_state_dir,
        batch_max_concurrency,
        file_quota,
    )
    return app


def api_key_id(key: str) -> str:
    """A stable id of an API key that does not reveal it: the first 16 hex digits of its
    SHA-256 (what /v1/files and /v1/batches record as an object's owner)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _authorized_key_id(header: str, wanted_digests: list[bytes]) -> str | None:
    """The id of the key in `Authorization: Bearer KEY` (the scheme in any case, RFC 7235)
    if it is one of the keys, else None. Every key is compared, in constant time, so the
    time taken says nothing about which key (or how much of one) matched."""
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    digest = hashlib.sha256(token.encode()).digest()
    matched = False
    for wanted in wanted_digests:
        matched |= secrets.compare_digest(digest, wanted)
    return api_key_id(token) if matched and scheme.lower() == "bearer" else None


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, by its Content-Length or,
    for a chunked body, as soon as the bytes received pass the limit."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        received = 0
        refused = False

        async def limited_receive() -> Any:
            # Over the limit: answer 413 now and tell the app the client left, so it stops
            # reading (raising here would become FastAPI's own 400 "error parsing the body").
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._refuse(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Any) -> None:
            if not refused:  # once refused, the app's own answer is dropped
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not refused:
                raise

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        response = error_response(
            f"Request body is larger than the server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes).",
            err_type="RequestEntityTooLarge",
            status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )
        await response(scope, receive, send)


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Server flags plus every engine flag (AsyncEngineArgs)."""
    if parser is None:
        parser = argparse.ArgumentParser(description="vLLM OpenAI-compatible API server.")
    parser.add_argument("--host", type=str, default=None, help="Host name (default: all).")
    parser.add_argument("--port", type=int, default=8000, help="Port number.")
    add_tls_args(parser)
    parser.add_argument(
        "--api-key",
        type=str,
        nargs="+",
        action="extend",
        default=None,
        help="If provided, the server will require one of these keys to be presented in the "
        "header ('Authorization: Bearer KEY') on every route but /health and /version; "
        "several keys as '--api-key K1 K2' or a repeated flag (default: env VLLM_API_KEY, "
        "which keeps the key out of ps).",
    )
    parser.add_argument(
        "--api-key-file",
        type=str,
        default=None,
        help="Read API keys from this file, one per line (blank lines and lines starting with "
        "'#' skipped), so they are not on the command line; adds to --api-key.",
    )
    parser.add_argument(
        "--allow-unauthenticated-metrics",
        action="store_true",
        help="With an API key, leave /metrics open (for a Prometheus scraper without the key).",
    )
    limits = ServerLimits()
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=limits.max_request_body_bytes,
        help="Larger request bodies are refused with 413.",
    )
    parser.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=limits.max_prompts_per_request,
        help="Most prompts one /v1/completions request may carry.",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Accept a chat_template sent in a request (refused by default, as in vLLM).",
    )
    parser.add_argument(
        "--chat-template-timeout",
        type=float,
        default=limits.chat_template_timeout_s,
        help="Seconds a chat template may take to render before the request gets a 400.",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=limits.shutdown_timeout_s,
        help="On SIGTERM/SIGINT: seconds in-flight requests get to finish before they are "
        "aborted with an error and the engine is shut down.",
    )
    parser.add_argument(
        "--chat-template", type=str, default=None, help="A Jinja chat template (file or text)."
    )
    add_tool_args(parser)
    add_batch_args(parser)
    parser.add_argument(
        "--response-role",
        type=str,
        default="assistant",
        help="The role of the generated chat message (when add_generation_prompt is true).",
    )
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="Logprobs name their tokens as 'token_id:{token_id}' (for tokens that are not "
        "valid text on their own).",
    )
    parser.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="Max number of characters of a request's parameters printed in the log "
        "(default: 1000).",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        type=str,
        default="info",
        choices=["debug", "info", "warning", "error", "critical", "trace"],
        help="Log level for uvicorn.",
    )
    parser.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="vLLM's flag: run the OpenAI frontend in the engine's process. Always so here "
        "(the stages are their own processes or Ray actors), so it changes nothing.",
    )
    add_lora_args(parser)
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


def build_engine(args: argparse.Namespace) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs.from_cli_args(args))


def api_keys_from_args(args: argparse.Namespace) -> list[str]:
    """--api-key's keys and --api-key-file's (one per line); with neither, VLLM_API_KEY (one
    key, as vLLM reads it). Empty: the server needs no key."""
    raw = args.api_key
    keys = [raw] if isinstance(raw, str) else list(raw or ())
    if any(not k.strip() for k in keys):
        raise ValueError("--api-key: a key must not be empty.")
    keys = [k.strip() for k in keys]
    path = getattr(args, "api_key_file", None)
    if path:
        with open(path, encoding="utf-8") as f:
            from_file = [k.strip() for k in f if k.strip() and not k.lstrip().startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {path} is empty (it holds no key).")
        keys += from_file
    if not keys:
        env_key = envs.get_str("VLLM_API_KEY")
        keys = [env_key] if env_key else []
    return list(dict.fromkeys(keys))  # each key once, in the order given


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    defaults = ServerLimits()
    return ServerLimits(
        max_request_body_bytes=getattr(
            args, "max_request_body_bytes", defaults.max_request_body_bytes
        ),
        max_prompts_per_request=getattr(
            args, "max_prompts_per_request", defaults.max_prompts_per_request
        ),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        chat_template_timeout_s=getattr(
            args, "chat_template_timeout", defaults.chat_template_timeout_s
        ),
        shutdown_timeout_s=getattr(args, "shutdown_timeout", defaults.shutdown_timeout_s),
        allow_unauthenticated_metrics=getattr(args, "allow_unauthenticated_metrics", False),
    )


class GracefulServer:
    """uvicorn.Server whose shutdown drains: on SIGTERM/SIGINT new requests get 503, the
    in-flight ones have `timeout_s` to finish, then the engine is shut down, which ends the
    rest with an error (InternalServerError in their streams), and the workers stop."""

    def __init__(self, config: Any, app: FastAPI, engine: AsyncLLMEngine, timeout_s: float):
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            async def shutdown(self, sockets: Any = None) -> None:
                await outer._drain(super().shutdown(sockets))

        self.server = _Server(config)
        self.app = app
        self.engine = engine
        self.timeout_s = timeout_s

    async def _drain(self, uvicorn_shutdown: Any) -> None:
        self.app.state.draining = True
        batches = getattr(self.app.state, "batches", None)
        if batches is not None:  # batch lines in flight are aborted, unrecorded: they resume
            await batches.stop()
        task = asyncio.ensure_future(uvicorn_shutdown)
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if not done:
            logger.warning(
                "Shutdown: requests still running after %.0f s; aborting them", self.timeout_s
            )
        # Ends every remaining stream with an error; its handler then completes the response.
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
        await task

    async def serve(self) -> None:
        await self.server.serve()

    def request_exit(self) -> None:
        """Begin the shutdown, as SIGTERM does (from the event loop's thread)."""
        self.server.should_exit = True


async def serve(args: argparse.Namespace, engine: AsyncLLMEngine | None = None) -> None:
    """Run the server until SIGTERM/SIGINT, then drain (--shutdown-timeout) and shut the
    engine down (its stages and, on Ray, the local Ray it started)."""
    import uvicorn

    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser to be set")

    from vllm.worker.cpu_memory import keep_malloc_defaults_in_this_process

    # The worker's malloc tuning (never trim) must not reach the API process: at PP=1 the
    # worker runs in this process, and request bodies would then never be returned.
    keep_malloc_defaults_in_this_process()
    tls = uvicorn_tls_kwargs(args)  # bad TLS flags fail before the engine loads
    engine = engine if engine is not None else build_engine(args)
    engine.max_log_len = getattr(args, "max_log_len", None)
    limits = limits_from_args(args)
    name = args.served_model_name
    names = ([name] if isinstance(name, str) else list(name)) if name else None
    loras = lora_requests(getattr(args, "lora_modules", None))
    for lora in loras:  # loaded on every stage before the first request
        await engine.add_lora(lora)
    app = build_app(
        engine,
        names,
        api_keys_from_args(args),
        args.chat_template,
        limits,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        batch_state_dir=getattr(args, "batch_state_dir", None),
        batch_max_concurrency=getattr(args, "batch_max_concurrency", None),
        file_quota=file_quota_from_args(args),
        return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
        response_role=getattr(args, "response_role", "assistant"),
        lora_requests=loras,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_keep_alive=5,
        # A backstop: the drain above ends every request first.
        timeout_graceful_shutdown=int(limits.shutdown_timeout_s) + 10,
        **tls,
    )
    host = args.host or "0.0.0.0"
    logger.info(
        "Serving %s on %s://%s:%d",
        engine.engine.served_model_name,
        scheme(args),
        host,
        args.port,
    )
    server = GracefulServer(config, app, engine, limits.shutdown_timeout_s)
    watchdog = EngineWatchdog(engine, server)
    app.state.on_engine_death = watchdog.check
    watch = asyncio.ensure_future(watchdog.run())
    try:
        await server.serve()
    finally:
        watch.cancel()
        engine.shutdown()  # a second call is a no-op
        app.state.work.shutdown()
    if watchdog.fired:
        raise SystemExit(1)  # the engine died: a supervisor must see a failure


class EngineWatchdog:
    """vLLM's engine-death shutdown: once the engine's loop has failed, the server logs it and
    stops (a drain that ends every open stream with the error, then exit status 1), unless
    VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set. Checked every `interval_s` and whenever a request
    finds the engine dead; /health answers 503 from the failure until the port closes."""

    def __init__(self, engine: AsyncLLMEngine, server: GracefulServer, interval_s: float = 1.0):
        self.engine = engine
        self.server = server
        self.interval_s = interval_s
        self.fired = False

    def check(self) -> bool:
        """Stop the server if the engine is dead (True when it did or had)."""
        if self.fired:
            return True
        if not self.engine.errored or envs.get_bool("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"):
            return False
        logger.critical("AsyncLLMEngine has failed, terminating server process")
        self.fired = True
        self.server.request_exit()
        return True

    async def run(self) -> None:
        while not self.check():
            await asyncio.sleep(self.interval_s)


def main(argv: list[str] | None = None) -> None:
    args = make_arg_parser().parse_args(argv)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
