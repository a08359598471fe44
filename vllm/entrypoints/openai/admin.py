"""Admin routes of the OpenAI-compatible server: the pipeline's layer split, read and changed
while serving. Behind the API key like every route but /health and /version (the key
middleware of `api_server.build_app` covers them).

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

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.openai.serving_engine import error_response, server_error
from vllm.logger import init_logger

logger = init_logger("vllm.entrypoints.openai.admin")


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
        "configured_pipeline_parallel_size": engine.engine.elastic.configured_pp,
        "layer_split": engine.engine.reshaper.current_split(),
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
        "reshapes": [event.as_dict() for event in engine.engine.reshaper.events],
        # Stages that left (could not be replaced) and came back.
        "resizes": [event.as_dict() for event in engine.engine.elastic.events],
    }


def attach_admin_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """Add the admin routes to `app`."""

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
