"""`RequestTracker`: vLLM 0.5's bookkeeping of an async engine's requests (new ones queued
for the next loop iteration, aborts, one stream per request), for code written against
`vllm.engine.async_llm_engine.RequestTracker`.

This engine's own loop (`AsyncLLMEngine`) hands requests to its engine thread directly; the
tracker is the same logic as a standalone object, used by callers that drive an engine from
their own asyncio loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, Callable

from vllm.logger import init_logger

logger = init_logger("vllm.engine.async_llm_engine")

ExceptionLike = BaseException | type[BaseException]


class TrackedStream:
    """One request's outputs in the tracker's loop (vLLM 0.5's `AsyncStream`): `put` outputs,
    `finish` (optionally with an exception), iterate with `async for`; leaving the iteration
    early aborts the request through `cancel`."""

    _DONE = object()

    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._finished = False

    def put(self, item: Any) -> None:
        if not self._finished:
            self._queue.put_nowait(item)

    def finish(self, exception: ExceptionLike | None = None) -> None:
        if not self._finished:
            self._finished = True
            self._queue.put_nowait(exception if exception is not None else self._DONE)

    @property
    def finished(self) -> bool:
        return self._finished

    async def generator(self) -> AsyncIterator[Any]:
        try:
            while True:
                item = await self._queue.get()
                if item is self._DONE:
                    return
                if isinstance(item, BaseException) or (
                    isinstance(item, type) and issubclass(item, BaseException)
                ):
                    raise item
                yield item
        except GeneratorExit:
            self._cancel(self.request_id)
            raise

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.generator()


class RequestTracker:
    """New and aborted requests, handed to the engine once per loop iteration by
    `get_new_and_aborted_requests`; a request added and aborted before that never reaches
    the engine."""

    def __init__(self) -> None:
        self._request_streams: dict[str, TrackedStream] = {}
        self._aborted_requests: asyncio.Queue[str] = asyncio.Queue()
        self._new_requests: asyncio.Queue[tuple[TrackedStream, dict[str, Any]]] = asyncio.Queue()
        self.new_requests_event = asyncio.Event()

    def __contains__(self, item: object) -> bool:
        return item in self._request_streams

    def __len__(self) -> int:
        return len(self._request_streams)

    def propagate_exception(self, exc: BaseException, request_id: str | None = None) -> None:
        """End one request's stream (or every stream) with `exc`."""
        ids = [request_id] if request_id is not None else list(self._request_streams)
        for rid in ids:
            self.abort_request(rid, exception=exc)

    def process_request_output(self, request_output: Any, *, verbose: bool = False) -> None:
        """Hand an engine output to its stream (ended when the request finished); an output
        of a request aborted meanwhile is dropped."""
        request_id = request_output.request_id
        finished = request_output.finished
        if finished:
            stream = self._request_streams.pop(request_id, None)
        else:
            stream = self._request_streams.get(request_id)
        if stream is not None:
            stream.put(request_output)
            if finished:
                stream.finish()
        if verbose and finished:
            logger.info("Finished request %s.", request_id)

    def process_exception(
        self, request_id: str, exception: BaseException, *, verbose: bool = False
    ) -> None:
        """End a request's stream with the engine's exception."""
        if verbose:
            logger.info("Finished request %s.", request_id)
        self.abort_request(request_id, exception=exception)

    def add_request(
        self, request_id: str, *, verbose: bool = False, **engine_add_request_kwargs: Any
    ) -> TrackedStream:
        """Queue a request for the engine's next iteration; KeyError if its id is taken."""
        if request_id in self._request_streams or any(
            s.request_id == request_id and not s.finished
            for s, _ in list(self._new_requests._queue)  # type: ignore[attr-defined]
        ):
            raise KeyError(f"Request {request_id} already exists.")
        stream = TrackedStream(request_id, partial(self.abort_request, verbose=verbose))
        self._new_requests.put_nowait(
            (stream, {"request_id": request_id, **engine_add_request_kwargs})
        )
        self.new_requests_event.set()
        if verbose:
            logger.info("Added request %s.", request_id)
        return stream

    def abort_request(
        self,
        request_id: str,
        *,
        exception: ExceptionLike | None = None,
        verbose: bool = False,
    ) -> None:
        """Queue an abort for the engine and end the request's stream now."""
        if verbose:
            logger.info("Aborted request %s.", request_id)
        self._aborted_requests.put_nowait(request_id)
        stream = self._request_streams.pop(request_id, None)
        if stream is not None:
            stream.finish(exception=exception)

    def get_new_and_aborted_requests(self) -> tuple[list[dict[str, Any]], set[str]]:
        """The requests to add (their add_request keywords) and the ids to abort."""
        new_requests: list[dict[str, Any]] = []
        finished_requests: set[str] = set()
        while not self._aborted_requests.empty():
            finished_requests.add(self._aborted_requests.get_nowait())
        while not self._new_requests.empty():
            stream, new_request = self._new_requests.get_nowait()
            if stream.request_id in finished_requests:
                # Added and aborted before the engine saw it: neither reaches the engine.
                stream.finish(asyncio.CancelledError)
                finished_requests.discard(stream.request_id)
            else:
                self._request_streams[stream.request_id] = stream
                new_requests.append(new_request)
        self.new_requests_event.clear()
        return new_requests, finished_requests

    async def wait_for_new_requests(self) -> None:
        if not self.has_new_requests():
            await self.new_requests_event.wait()
        self.new_requests_event.clear()

    def has_new_requests(self) -> bool:
        return not self._new_requests.empty()
