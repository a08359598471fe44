"""`GET /health` for both servers: vLLM's 200 (empty body) or 503, plus "degraded".

- 200, empty body: healthy (exactly vLLM's answer).
- 200 with `{"status": "degraded", "message": ..., "stages": [ranks]}` and the header
  `X-Health-Status: degraded`: a stage failed and is being replaced -- or was found failed
  (stopped, gone, silent) and the next step replaces it. The server accepts requests; the
  ones in flight continue once the stage is back. A load balancer that reads only the status
  code keeps the server, as it should.
- 503 `ServiceUnavailableError`: the engine is dead (its loop failed, restarts used up), or a
  stage failed that cannot be replaced. Requests would fail.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse, Response

from vllm.engine.async_llm_engine import AsyncEngineDeadError
from vllm.entrypoints.openai.serving_engine import error_response
from vllm.resilience.errors import StageFailedError

HEALTH_HEADER = "X-Health-Status"


async def health_response(engine: Any) -> Response:
    """The /health answer for `engine` (an AsyncLLMEngine), as described above."""
    try:
        health = await engine.health()
    except (AsyncEngineDeadError, StageFailedError) as exc:
        response = error_response(
            str(exc), err_type="ServiceUnavailableError", status=HTTPStatus.SERVICE_UNAVAILABLE
        )
        response.headers[HEALTH_HEADER] = "dead"
        return response
    if not health.degraded:
        return Response(status_code=200)
    body = {"status": health.status, "message": health.message, "stages": health.ranks}
    return JSONResponse(body, status_code=200, headers={HEALTH_HEADER: health.status})
