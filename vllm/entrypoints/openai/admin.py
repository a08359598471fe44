"""Admin routes of the OpenAI-compatible server: the pipeline's layer split, read and changed
while serving.

Off by default: they are mounted only when the server has an API key (the key middleware of
`api_server.build_app` then guards them like every route but /health and /version) or when the
operator opts in with vLLM's development-mode switch `VLLM_SERVER_DEV_MODE=1` (then, without a
key, anyone who reaches the port may re-split the pipeline: a WARNING says so at startup).
Otherwise every `/v1/admin/*` request gets a 403 that names both ways to turn them on (not a
bare 404: the routes exist in this server, and the answer says how to reach them).

- `GET /v1/admin/pipeline`: the split (layers per stage) and each rank's stage, layers, host
  and pid.
- `POST /v1/admin/reshape_pipeline {"layer_split": [a, b, ...]}`: re-split the layers
  (`LLMEngine.reshape_pipeline`); streams in flight go on. 400 naming `layer_split` on bad
  input.
- `POST /v1/admin/grow_pipeline`: start the stages a shrunk pipeline is missing now
  (`LLMEngine.grow_pipeline`, a stage that could not be replaced); `{"grown": bool}` and the
  pipeline.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt

from vllm import envs
from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.openai.serving_engine import error_response, server_error
from vllm.logger import init_logger

logger = init_logger("vllm.entrypoints.openai.admin")

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
ADMIN_PREFIX = "/v1/admin"
ADMIN_OFF_MESSAGE = (
    "The admin routes (/v1/admin/*) are off: start the server with an API key (--api-key, "
    f"--api-key-file or VLLM_API_KEY) or set {DEV_MODE_ENV}=1 to turn them on."
)


class ReshapePipelineRequest(BaseModel):
    """The body of `POST /v1/admin/reshape_pipeline`."""

    model_config = ConfigDict(extra="forbid")

    layer_split: list[StrictInt]


async def pipeline_view(engine: AsyncLLMEngine) -> dict[str, Any]:
    """The split and where each rank runs, as the admin routes show it."""
    infos = await engine.get_stage_infos()
    return {
        "pipeline_parallel_size": engine.engine.parallel_config.pipeline_parallel_size,
        # Larger than the size now while a stage that could not be replaced is missing.
        "configured_pipeline_parallel_size": engine.engine.resilience.resizes.configured_pp,
        "layer_split": engine.engine.resilience.reshaper.current_split(),
        "stages": [
            {
                "rank": info.rank,
                "pp_rank": info.pp_rank,
                "tp_rank": info.tp_rank,
                "layers": list(info.layers) if info.layers is not None else None,
                "host": info.host,
                "pid": info.pid,
            }
            for info in infos
        ],
        "reshapes": [event.as_dict() for event in engine.engine.resilience.reshaper.events],
        # Stages that left (could not be replaced) and came back.
        "resizes": [event.as_dict() for event in engine.engine.resilience.resizes.events],
    }


def mount_admin_routes(app: FastAPI, engine: AsyncLLMEngine, api_key_set: bool) -> bool:
    """Add the admin routes to `app` when a key guards them or dev mode is on; otherwise a
    403 for every `/v1/admin/*` path. Returns whether they were mounted."""
    dev_mode = envs.get_bool(DEV_MODE_ENV)
    if not (api_key_set or dev_mode):
        _refuse_admin_routes(app)
        return False
    if not api_key_set:
        logger.warning(
            "%s=1 and no API key: the admin routes (%s/*) are open to anyone who can reach "
            "this server (they re-split the pipeline and show host names and pids). Set "
            "--api-key, or bind --host 127.0.0.1.",
            DEV_MODE_ENV,
            ADMIN_PREFIX,
        )
    attach_admin_routes(app, engine)
    return True


def _refuse_admin_routes(app: FastAPI) -> None:
    @app.api_route(ADMIN_PREFIX + "/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def admin_off(request: Request, path: str) -> JSONResponse:
        return error_response(
            ADMIN_OFF_MESSAGE, err_type="PermissionDeniedError", status=HTTPStatus.FORBIDDEN
        )


def attach_admin_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """Add the admin routes to `app` (unconditionally: `mount_admin_routes` decides)."""

    @app.get("/v1/admin/pipeline")
    async def show_pipeline() -> JSONResponse:
        return JSONResponse(await pipeline_view(engine))

    @app.post("/v1/admin/reshape_pipeline")
    async def reshape_pipeline(request: ReshapePipelineRequest) -> JSONResponse:
        logger.info("Admin: re-split the pipeline as %s", request.layer_split)
        try:
            event = await engine.reshape_pipeline(request.layer_split)
        except ValueError as exc:
            return error_response(str(exc), param="layer_split")
        except Exception as exc:  # the engine's failure, not the request's
            logger.exception("Admin: the re-split failed")
            return server_error(exc)
        body = event.as_dict()
        body["pipeline"] = await pipeline_view(engine)
        return JSONResponse(body)

    @app.post("/v1/admin/grow_pipeline")
    async def grow_pipeline() -> JSONResponse:
        logger.info("Admin: grow the pipeline back")
        try:
            grown = await engine.grow_pipeline()
        except Exception as exc:  # the engine's failure, not the request's
            logger.exception("Admin: growing the pipeline failed")
            return server_error(exc)
        return JSONResponse({"grown": grown, "pipeline": await pipeline_view(engine)})
