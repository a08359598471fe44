"""`GET /health` (`vllm.entrypoints.health`): vLLM's empty 200 when healthy, 200 with a
"degraded" body and header while a stage is being replaced, 503 once the engine is dead or a
failed stage cannot be replaced. A stand-in engine; no server, no torch."""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm.engine.async_llm_engine import AsyncEngineDeadError
from vllm.entrypoints.health import HEALTH_HEADER, health_response
from vllm.resilience.errors import StageFailedError, StageFailure
from vllm.resilience.events import EngineHealth

pytestmark = pytest.mark.fast


class _Engine:
    def __init__(self, answer: EngineHealth | BaseException) -> None:
        self.answer = answer

    async def health(self) -> EngineHealth:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def _get(answer: EngineHealth | BaseException):
    return asyncio.run(health_response(_Engine(answer)))


def test_healthy_is_vllms_empty_200():
    response = _get(EngineHealth())
    assert response.status_code == 200 and response.body == b""
    assert HEALTH_HEADER not in response.headers


def test_degraded_is_200_with_a_body_and_header():
    response = _get(EngineHealth("degraded", "replacing failed stage(s): stage 1 ...", [1]))
    assert response.status_code == 200
    assert response.headers[HEALTH_HEADER] == "degraded"
    body = json.loads(response.body)
    assert body == {
        "status": "degraded",
        "message": "replacing failed stage(s): stage 1 ...",
        "stages": [1],
    }


@pytest.mark.parametrize(
    "error",
    [
        AsyncEngineDeadError("Background loop has errored already: EngineDeadError: x"),
        StageFailedError([StageFailure(1, "stage 1 (rank 1)", "process 9 is stopped")], 0.0),
    ],
    ids=["dead", "unreplaceable-stage"],
)
def test_dead_is_503(error):
    response = _get(error)
    assert response.status_code == 503
    assert response.headers[HEALTH_HEADER] == "dead"
    body = json.loads(response.body)
    assert body["type"] == "ServiceUnavailableError" and str(error) in body["message"]
