"""A request that failed inside a stage, told apart from a stage that failed.

The sampler runs code and parameters that belong to one request (its logits processors, its
penalties, filters and seeded draws). When that work raises, the request is at fault, not the
stage: the stage answers the step as usual, with the failing groups marked
(`SequenceGroupOutput.error`), keeps its process groups, and the engine ends those requests
with this error while the others go on. No torch here: the engine and the server import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class RequestFailedError(RuntimeError):
    """Request(s) whose own work raised inside a stage; the message names them and says
    what raised. Picklable (it crosses from stage processes to the engine)."""

    def __init__(self, request_ids: Iterable[str], message: str) -> None:
        self.request_ids = list(request_ids)
        self.message = message
        super().__init__(f"Request {', '.join(self.request_ids)} failed: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (RequestFailedError, (self.request_ids, self.message))


def describe(exc: BaseException, where: str) -> str:
    """One line for a per-request error: where it happened, its type and message (cut)."""
    text = str(exc).strip().replace("\n", " ")
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{where} raised {type(exc).__name__}: {text}"
