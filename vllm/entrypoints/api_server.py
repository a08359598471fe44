"""vLLM's legacy demo server (not the OpenAI API; that is `vllm.entrypoints.openai.api_server`).

    python -m vllm.entrypoints.api_server --model MODEL [engine flags] [--port 8000]

`POST /generate` takes `{"prompt": ..., "stream": false, <SamplingParams fields>}` and answers
`{"text": [prompt + output, ...]}` (one per output); with `"stream": true` each update is such
a JSON object followed by a NUL byte. `GET /health`. A client that leaves aborts its request.
Bad sampling parameters are a 400 with the ValueError's message (vLLM answers 500).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.health import health_response
from vllm.entrypoints.openai.serving_engine import ClientDisconnected, until_disconnected
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams

logger = init_logger("vllm.entrypoints.api_server")

TIMEOUT_KEEP_ALIVE = 5  # seconds

app = FastAPI()
# The engine /generate uses, set by `init_app` (module globals, as in vLLM's demo).
engine: AsyncLLMEngine | None = None


def _uuid() -> str:
    import uuid

    return uuid.uuid4().hex


@app.get("/health")
async def health() -> Response:
    """200 while the engine serves (a JSON body when degraded), 503 once it is dead."""
    if engine is None:
        return Response(status_code=200)
    return await health_response(engine)


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=400)


@app.post("/generate")
async def generate(request: Request) -> Response:
    """Generate text for `prompt` with the other fields as SamplingParams."""
    assert engine is not None, "init_app() was not called"
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
    except (TypeError, ValueError) as exc:
        return _bad_request(str(exc))
    results = engine.generate(prompt, sampling_params, _uuid())

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


def build_app(args: argparse.Namespace) -> FastAPI:
    app.root_path = getattr(args, "root_path", None) or ""
    return app


async def init_app(args: argparse.Namespace, llm_engine: AsyncLLMEngine | None = None) -> FastAPI:
    """The app, with `llm_engine` (or one built from the engine flags) behind /generate."""
    global engine
    built = build_app(args)
    engine = (
        llm_engine
        if llm_engine is not None
        else AsyncLLMEngine.from_engine_args(AsyncEngineArgs.from_cli_args(args))
    )
    return built


async def run_server(
    args: argparse.Namespace, llm_engine: AsyncLLMEngine | None = None, **uvicorn_kwargs: Any
) -> None:
    """Serve until SIGINT/SIGTERM, then shut the engine down."""
    import uvicorn

    served = await init_app(args, llm_engine)
    config = uvicorn.Config(
        served,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=TIMEOUT_KEEP_ALIVE,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        **uvicorn_kwargs,
    )
    try:
        await uvicorn.Server(config).serve()
    finally:
        if engine is not None:
            engine.shutdown()


def make_arg_parser() -> argparse.ArgumentParser:
    """vLLM's demo-server flags plus every engine flag."""
    parser = argparse.ArgumentParser(description="vLLM demo API server (/generate).")
    parser.add_argument("--host", type=str, default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ssl-keyfile", type=str, default=None)
    parser.add_argument("--ssl-certfile", type=str, default=None)
    parser.add_argument("--ssl-ca-certs", type=str, default=None, help="The CA certificates file")
    parser.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        help="Whether client certificate is required (see stdlib ssl module's)",
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
