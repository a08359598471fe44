"""Online batch jobs: OpenAI's `/v1/files` and `/v1/batches` on the server's own engine.

    POST   /v1/files                  multipart `file` + `purpose=batch` -> FileObject
    GET    /v1/files[?purpose=]       list;  GET /v1/files/{id};  DELETE /v1/files/{id}
    GET    /v1/files/{id}/content     the bytes (a batch's output and error files too)
    POST   /v1/batches                {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches[?limit=&after=];  GET /v1/batches/{id};  POST /v1/batches/{id}/cancel

A batch goes validating -> in_progress -> finalizing -> completed (or failed: an input with no
lines; cancelling -> cancelled; expired once its `completion_window` has passed, its unfinished
lines then `batch_expired` error lines), as OpenAI's. Its lines run through the same handlers as
`/v1/completions` and `/v1/chat/completions` (`batch_lines`), so a line's output equals the
server's answer to the same body.

Lower priority than interactive requests: the scheduler has no priority notion (FCFS), so batch
lines are instead capped: at most `--batch-max-concurrency` of them (all batches together; by
default half of `--max-num-seqs`) are in the engine at once, which leaves the other sequence
slots to interactive requests; the remaining lines wait in the server, not in the scheduler.

Durability (`--batch-state-dir`, see `batch_store`): each finished line's output is appended
and fsync'd to the batch's journal before it is counted. On SIGTERM the lines in flight are
aborted without a record; a server restarted on the same directory resumes every unfinished
batch and runs only the lines with no recorded output, so each line appears exactly once in the
output. Output files have ids derived from the batch's, so an interrupted finalization simply
writes them again. One server at a time owns a state directory (a lock file); a second one
started on it serves no batch API (503) rather than run the same lines twice.

Ownership: with API keys (`--api-key`), each file and batch belongs to the key that created it
(`request.state.api_key_id`, set by the server's authentication), and every other key gets 404
for it, in listings too, as OpenAI answers for an id you cannot see; a batch's output files
belong to the batch's owner. Without keys everything is shared by every client; an object
created while the server had no key belongs to no key, so once keys are set no client sees it.
Uploaded files (not a batch's output files) count against a quota per key (or, without keys,
for the whole server): `--max-files-per-key` files and `--max-file-bytes-per-key` bytes, a 429
`insufficient_quota` naming the limit beyond; expired and deleted files do not count.

Expiry: OpenAI's `expires_after` on `POST /v1/files` (multipart fields `expires_after[anchor]`
= `created_at`, `expires_after[seconds]` from 3600 to 2592000) sets the file's `expires_at`,
and `output_expires_after` on `POST /v1/batches` the same for the batch's output and error
files. An expired file answers 404 at once; a sweep (every `_SWEEP_INTERVAL_S`) deletes it.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import fcntl
import json
import os
import re
import time
from email import policy
from email.parser import BytesParser
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vllm.engine.async_llm_engine import AsyncEngineDeadError
from vllm.entrypoints.openai.batch_lines import (
    EMBEDDINGS,
    SUPPORTED_URLS,
    BatchLineRunner,
    BatchRequestInput,
    BatchRequestOutput,
    parse_lines,
)
from vllm.entrypoints.openai.batch_store import (
    BatchStore,
    FileQuota,
    QuotaExceededError,
    default_state_dir,
)
from vllm.entrypoints.openai.protocol import random_uuid
from vllm.entrypoints.openai.serving_engine import error_response
from vllm.logger import init_logger

logger = init_logger("vllm.entrypoints.openai.batches")

# Statuses whose batch still has work to do (resumed after a restart).
_ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
_WINDOW = re.compile(r"^([1-9][0-9]*)([smh])$")
_WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600}
_SAVE_INTERVAL_S = 0.5  # request_counts are persisted at most this often while lines run
_SWEEP_INTERVAL_S = 60.0  # expired files are removed from disk at least this often
# OpenAI's range of `expires_after.seconds` (files) and `output_expires_after.seconds`.
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 24 * 3600
DEFAULT_MAX_FILES_PER_KEY = 1000
DEFAULT_MAX_FILE_BYTES_PER_KEY = 1 << 30
_UPLOAD_FIELDS = ("file", "purpose", "expires_after[anchor]", "expires_after[seconds]")
_BATCH_FIELDS = (
    "input_file_id",
    "endpoint",
    "completion_window",
    "metadata",
    "output_expires_after",
)


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """The `/v1/batches` flags of `vllm serve`."""
    parser.add_argument(
        "--batch-state-dir",
        type=str,
        default=None,
        help="Where /v1/files and /v1/batches keep their files and job state, so a restarted "
        f"server resumes unfinished batches (default: {default_state_dir()}).",
    )
    parser.add_argument(
        "--batch-max-concurrency",
        type=int,
        default=None,
        help="Most /v1/batches lines in the engine at once, all batches together (default: "
        "half of --max-num-seqs), so interactive requests keep the other slots.",
    )
    parser.add_argument(
        "--max-files-per-key",
        type=int,
        default=DEFAULT_MAX_FILES_PER_KEY,
        help="Most files one API key (without --api-key: all clients together) may keep "
        "uploaded in /v1/files; expired and deleted files do not count.",
    )
    parser.add_argument(
        "--max-file-bytes-per-key",
        type=int,
        default=DEFAULT_MAX_FILE_BYTES_PER_KEY,
        help="Most bytes of uploaded files one API key (without --api-key: all clients "
        "together) may keep in /v1/files (default: 1 GiB).",
    )


def file_quota_from_args(args: argparse.Namespace) -> FileQuota:
    """The FileQuota of `--max-files-per-key` and `--max-file-bytes-per-key`."""
    return FileQuota(
        max_files=getattr(args, "max_files_per_key", DEFAULT_MAX_FILES_PER_KEY),
        max_bytes=getattr(args, "max_file_bytes_per_key", DEFAULT_MAX_FILE_BYTES_PER_KEY),
    )


def parse_completion_window(value: Any) -> int:
    """Seconds of a `completion_window`: OpenAI's "24h", or any `<n>h`, `<n>m`, `<n>s`."""
    match = _WINDOW.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"completion_window must be like '24h' (hours, 'm' minutes or 's' seconds), "
            f"got {value!r}."
        )
    return int(match.group(1)) * _WINDOW_UNITS[match.group(2)]


def parse_expires_after(anchor: Any, seconds: Any, field: str) -> int:
    """Seconds of OpenAI's `{anchor: "created_at", seconds: N}` (N from 3600 to 2592000)."""
    if anchor != "created_at":
        raise ValueError(f"{field}.anchor must be 'created_at', got {anchor!r}.")
    if isinstance(seconds, str) and seconds.strip().isdigit():
        seconds = int(seconds)  # a multipart field is text
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        raise ValueError(f"{field}.seconds must be an integer, got {seconds!r}.")
    if not MIN_EXPIRES_AFTER_S <= seconds <= MAX_EXPIRES_AFTER_S:
        raise ValueError(
            f"{field}.seconds must be between {MIN_EXPIRES_AFTER_S} (1 hour) and "
            f"{MAX_EXPIRES_AFTER_S} (30 days), got {seconds}."
        )
    return seconds


def parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """The fields of a multipart/form-data body: name -> (filename, bytes)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise ValueError("file: the upload must be multipart/form-data.")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    message = BytesParser(policy=policy.HTTP).parsebytes(head + body)
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields


def _not_found(kind: str, object_id: str, param: str) -> JSONResponse:
    return error_response(
        f"No such {kind} object: {object_id}",
        err_type="NotFoundError",
        status=HTTPStatus.NOT_FOUND,
        param=param,
    )


def _page(objects: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's cursor page of `objects` (newest first)."""
    ordered = sorted(objects, key=lambda o: (o["created_at"], o["id"]), reverse=True)
    if after is not None:
        ids = [o["id"] for o in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > limit,
    }


class _StateDirLock:
    """An exclusive lock on a state directory for this process's lifetime."""

    def __init__(self, root: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.fd = os.open(os.path.join(root, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1


class BatchManager:
    """Runs the batches of one store on the server's engine (see the module docstring)."""

    def __init__(
        self,
        store: BatchStore,
        runner: BatchLineRunner,
        max_concurrency: int,
        quota: FileQuota | None = None,
    ) -> None:
        self.store = store
        self.runner = runner
        self.max_concurrency = max_concurrency
        self.quota = quota or FileQuota(DEFAULT_MAX_FILES_PER_KEY, DEFAULT_MAX_FILE_BYTES_PER_KEY)
        # Shared by all batches: the cap on batch lines in the engine (binds to the server's
        # event loop on first use).
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._drivers: dict[str, asyncio.Task] = {}
        self._lines: dict[str, set[asyncio.Task]] = {}
        # The batches being driven: the one copy their driver and cancel() update (the store
        # holds the last saved version).
        self._live: dict[str, dict[str, Any]] = {}
        self._stopping = False
        self._sweeper: asyncio.Task | None = None

    def visible(self, object_id: str, viewer: str | None) -> bool:
        """Whether the client with key id `viewer` may see a file or batch: its owner's key,
        or any client when the server has no keys (`viewer` None)."""
        return viewer is None or self.store.owners.get(object_id) == viewer

    def get(self, batch_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        """The batch as it is now (its counts up to date), or None (also when `viewer` may
        not see it)."""
        batch = self._live.get(batch_id) or self.store.batches.get(batch_id)
        if batch is None or not self.visible(batch_id, viewer):
            return None
        return copy.deepcopy(batch)

    def all_batches(self, viewer: str | None = None) -> list[dict[str, Any]]:
        return [b for b in (self.get(i, viewer) for i in list(self.store.batches)) if b]

    def file(self, file_id: str, viewer: str | None) -> dict[str, Any] | None:
        """The file, or None if it does not exist, has expired or `viewer` may not see it."""
        file = self.store.live_file(file_id)
        return file if file is not None and self.visible(file_id, viewer) else None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Resume every batch a previous server left unfinished; start the expiry sweep."""
        for batch in list(self.store.batches.values()):
            if batch["status"] in _ACTIVE:
                logger.info("Resuming batch %s (%s)", batch["id"], batch["status"])
                self._drive(batch["id"])
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.store.sweep)
            except OSError:  # a disk error: try again at the next round
                logger.exception("Removing expired files failed")
            await asyncio.sleep(_SWEEP_INTERVAL_S)

    async def stop(self) -> None:
        """Abort the lines in flight (unrecorded: they run again after a restart) and stop."""
        if self._stopping:
            return
        self._stopping = True
        tasks = list(self._drivers.values())
        if self._sweeper is not None:
            tasks.append(self._sweeper)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _drive(self, batch_id: str) -> None:
        task = asyncio.create_task(self._run_batch(batch_id))
        self._drivers[batch_id] = task
        task.add_done_callback(lambda _: self._drivers.pop(batch_id, None))

    # -- requests -----------------------------------------------------------------------------

    async def create(
        self, body: dict[str, Any], owner: str | None = None
    ) -> dict[str, Any] | JSONResponse:
        """A new batch owned by the key id `owner` (None: the server has no keys)."""
        unknown = sorted(set(body) - set(_BATCH_FIELDS))
        if unknown:
            return error_response(
                f"Unknown field(s) {', '.join(unknown)}; a batch takes {', '.join(_BATCH_FIELDS)}.",
                param=unknown[0],
            )
        endpoint = body.get("endpoint")
        if endpoint == EMBEDDINGS:
            return error_response(
                "The model does not support Embeddings API (this server generates text).",
                param="endpoint",
            )
        if endpoint not in SUPPORTED_URLS:
            return error_response(
                f"endpoint must be one of {', '.join(SUPPORTED_URLS)}, got {endpoint!r}.",
                param="endpoint",
            )
        try:
            window_s = parse_completion_window(body.get("completion_window"))
        except ValueError as exc:
            return error_response(str(exc), param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            return error_response("metadata must be an object.", param="metadata")
        output_expires_after = body.get("output_expires_after")
        if output_expires_after is not None:
            if not isinstance(output_expires_after, dict):
                return error_response(
                    "output_expires_after must be an object {anchor, seconds}.",
                    param="output_expires_after",
                )
            try:
                seconds = parse_expires_after(
                    output_expires_after.get("anchor"),
                    output_expires_after.get("seconds"),
                    "output_expires_after",
                )
            except ValueError as exc:
                return error_response(str(exc), param="output_expires_after")
            output_expires_after = {"anchor": "created_at", "seconds": seconds}
        file_id = body.get("input_file_id")
        file = self.file(file_id, owner) if isinstance(file_id, str) else None
        if file is None or not isinstance(file_id, str):
            return _not_found("File", str(file_id), "input_file_id")
        if file["purpose"] != "batch":
            return error_response(
                f"input_file_id {file_id} was uploaded with purpose {file['purpose']!r}, "
                "not 'batch'.",
                param="input_file_id",
            )
        now = int(time.time())
        batch: dict[str, Any] = {
            "id": f"batch_{random_uuid()}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": file_id,
            "completion_window": body["completion_window"],
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + window_s,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        if output_expires_after is not None:
            batch["output_expires_after"] = output_expires_after
        data = await asyncio.to_thread(self.store.read_file, file_id)
        await asyncio.to_thread(self.store.create_batch, batch, data, owner)
        self._drive(batch["id"])
        return batch

    async def cancel(
        self, batch_id: str, viewer: str | None = None
    ) -> dict[str, Any] | JSONResponse:
        batch = self._live.get(batch_id) or self.store.batches.get(batch_id)
        if batch is None or not self.visible(batch_id, viewer):
            return _not_found("Batch", batch_id, "batch_id")
        if batch["status"] == "cancelling":
            return copy.deepcopy(batch)
        if batch["status"] not in ("validating", "in_progress"):
            return error_response(
                f"Cannot cancel a batch with status '{batch['status']}'.",
                err_type="ConflictError",
                status=HTTPStatus.CONFLICT,
                param="batch_id",
            )
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        await self._save(batch)
        for task in list(self._lines.get(batch_id, ())):
            task.cancel()  # aborts its engine request; the driver then finalizes
        if batch_id not in self._drivers:
            self._drive(batch_id)
        return copy.deepcopy(batch)

    # -- running ------------------------------------------------------------------------------

    async def _save(self, batch: dict[str, Any]) -> None:
        await asyncio.to_thread(self.store.save_batch, copy.deepcopy(batch))

    async def _run_batch(self, batch_id: str) -> None:
        batch = self._live.setdefault(batch_id, copy.deepcopy(self.store.batches[batch_id]))
        try:
            items = await asyncio.to_thread(self._read_lines, batch_id)
            batch["request_counts"]["total"] = len(items)
            if batch["status"] == "validating":
                if not items:
                    await self._fail(batch, "empty_file", "The input file has no requests.")
                    return
                batch.update(status="in_progress", in_progress_at=int(time.time()))
                await self._save(batch)
            final = {"finalizing": "completed", "cancelling": "cancelled"}.get(batch["status"])
            if batch["status"] == "in_progress":
                final = await self._run_lines(batch, items)
            assert final is not None, batch["status"]
            await self._finalize(batch, items, final)
        except asyncio.CancelledError:
            raise  # the server is stopping: resumed on restart
        except AsyncEngineDeadError:
            logger.warning("Batch %s paused: the engine is not running", batch_id)
        except Exception as exc:  # a bug or a disk error: fail this batch, not the server
            logger.exception("Batch %s failed", batch_id)
            await self._fail(batch, "server_error", f"{type(exc).__name__}: {exc}")
        finally:
            if batch["status"] not in _ACTIVE:
                self._live.pop(batch_id, None)

    def _read_lines(self, batch_id: str) -> list[BatchRequestInput | BatchRequestOutput]:
        return parse_lines(self.store.read_input(batch_id))

    async def _fail(self, batch: dict[str, Any], code: str, message: str) -> None:
        error = {"code": code, "message": message, "param": None, "line": None}
        batch.update(
            status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [error]}
        )
        await self._save(batch)

    async def _run_lines(
        self, batch: dict[str, Any], items: list[BatchRequestInput | BatchRequestOutput]
    ) -> str:
        """Run the lines with no recorded output; the batch's next status."""
        batch_id = batch["id"]
        results = await asyncio.to_thread(self.store.load_results, batch_id)
        counts = batch["request_counts"]
        counts.update(
            completed=sum(_ok(o) for o in results.values()),
            failed=sum(not _ok(o) for o in results.values()),
        )
        last_save = 0.0

        async def record(index: int, output: BatchRequestOutput) -> None:
            nonlocal last_save
            data = output.model_dump()
            await asyncio.to_thread(self.store.append_result, batch_id, index, data)
            counts["completed" if output.ok else "failed"] += 1
            if time.monotonic() - last_save > _SAVE_INTERVAL_S:
                last_save = time.monotonic()
                await self._save(batch)

        async def run(index: int, request: BatchRequestInput) -> None:
            async with self._semaphore:
                output = await self.runner.run(request, batch["endpoint"])
            if not self._stopping:  # a line cut by shutdown is not recorded: it runs again
                await record(index, output)

        for index, item in enumerate(items):
            if index not in results and isinstance(item, BatchRequestOutput):
                await record(index, item)  # a line that cannot run: its error line at once
        tasks = {
            asyncio.create_task(run(i, item))
            for i, item in enumerate(items)
            if i not in results
            and isinstance(item, BatchRequestInput)
            and batch["status"] == "in_progress"  # not cancelled meanwhile
        }
        self._lines[batch_id] = tasks
        try:
            timeout = max(0.0, batch["expires_at"] - time.time())
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._lines.pop(batch_id, None)
        if batch["status"] == "cancelling":  # set by cancel()
            return "cancelled"
        if any(not t.done() or t.cancelled() for t in tasks):
            return "expired"
        return "completed"

    async def _finalize(
        self,
        batch: dict[str, Any],
        items: list[BatchRequestInput | BatchRequestOutput],
        final: str,
    ) -> None:
        """Write the output and error files from the journal, in input order; then the final
        status. Re-running it (after a crash while finalizing) writes the same files."""
        if final == "cancelled" or batch["status"] == "cancelling":
            final = "cancelled"
        elif final == "completed":
            batch.update(status="finalizing", finalizing_at=int(time.time()))
            await self._save(batch)
        ok_lines, error_lines = await asyncio.to_thread(
            self._output_lines, batch["id"], items, final == "expired"
        )
        batch_id = batch["id"]
        expires_after = batch.get("output_expires_after")
        # The output files belong to the batch's owner; they expire when it asked.
        expires_at = int(time.time()) + expires_after["seconds"] if expires_after else None
        for kind, lines in (("output", ok_lines), ("error", error_lines)):
            if lines:
                data = ("\n".join(lines) + "\n").encode()
                file = await asyncio.to_thread(
                    self.store.add_file,
                    data,
                    f"{batch_id}_{kind}.jsonl",
                    f"batch_{kind}",
                    f"file-{batch_id}-{kind}",
                    self.store.owners.get(batch_id),
                    expires_at,
                )
                batch[f"{kind}_file_id"] = file["id"]
        batch["request_counts"].update(completed=len(ok_lines), failed=len(error_lines))
        batch.update({"status": final, f"{final}_at": int(time.time())})
        await self._save(batch)
        logger.info(
            "Batch %s %s: %d ok, %d failed", batch_id, final, len(ok_lines), len(error_lines)
        )

    def _output_lines(
        self,
        batch_id: str,
        items: list[BatchRequestInput | BatchRequestOutput],
        expired: bool,
    ) -> tuple[list[str], list[str]]:
        """The output and error files' lines from the journal, in input order; with
        `expired`, a `batch_expired` error line for each line that did not finish."""
        results = self.store.load_results(batch_id)
        ok_lines: list[str] = []
        error_lines: list[str] = []
        for index, item in enumerate(items):
            output = results.get(index)
            if output is None and expired:
                custom_id = item.custom_id if isinstance(item, BatchRequestInput) else None
                output = {
                    "id": f"vllm-{random_uuid()}",
                    "custom_id": custom_id,
                    "response": None,
                    "error": {
                        "code": "batch_expired",
                        "message": "This request could not be executed before the "
                        "completion window expired.",
                    },
                }
            if output is not None:
                (ok_lines if _ok(output) else error_lines).append(json.dumps(output))
        return ok_lines, error_lines


def _ok(output: dict[str, Any]) -> bool:
    response = output.get("response")
    if output.get("error") is not None or not isinstance(response, dict):
        return False
    return bool(response.get("status_code") == 200)


def _viewer(request: Request) -> str | None:
    """The id of the API key the request was authenticated with (None: no keys are set)."""
    return getattr(request.state, "api_key_id", None)


def build_router(manager: BatchManager | None, unavailable: str = "") -> APIRouter:
    """The /v1/files and /v1/batches routes (503 `unavailable` when `manager` is None)."""
    router = APIRouter()

    def disabled() -> JSONResponse | None:
        if manager is not None:
            return None
        return error_response(
            unavailable,
            err_type="ServiceUnavailableError",
            status=HTTPStatus.SERVICE_UNAVAILABLE,
        )

    @router.post("/v1/files")
    async def upload_file(request: Request) -> Any:
        if (error := disabled()) is not None or manager is None:
            return error
        try:
            # Off the event loop: the parser takes ~50 ms per MB.
            body = await request.body()
            content_type = request.headers.get("content-type", "")
            fields = await asyncio.to_thread(parse_multipart, content_type, body)
        except ValueError as exc:
            return error_response(str(exc), param="file")
        unknown = sorted(set(fields) - set(_UPLOAD_FIELDS))
        if unknown:
            return error_response(
                f"Unknown field(s) {', '.join(unknown)}; an upload takes "
                f"{', '.join(_UPLOAD_FIELDS)}.",
                param=unknown[0],
            )
        purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace")
        if purpose != "batch":
            return error_response(
                f"purpose must be 'batch' (the only use of files here), got {purpose!r}.",
                param="purpose",
            )
        if "file" not in fields:
            return error_response("file is required.", param="file")
        expires_at = None
        if "expires_after[anchor]" in fields or "expires_after[seconds]" in fields:
            anchor = fields.get("expires_after[anchor]", (None, b""))[1].decode("utf-8", "replace")
            seconds = fields.get("expires_after[seconds]", (None, b""))[1].decode(
                "utf-8", "replace"
            )
            try:
                expires_at = int(time.time()) + parse_expires_after(
                    anchor, seconds, "expires_after"
                )
            except ValueError as exc:
                return error_response(str(exc), param="expires_after")
        filename, data = fields["file"]
        try:
            obj = await asyncio.to_thread(
                manager.store.add_file,
                data,
                filename or "upload.jsonl",
                purpose,
                owner=_viewer(request),
                expires_at=expires_at,
                quota=manager.quota,
            )
        except QuotaExceededError as exc:
            return error_response(
                str(exc), err_type="insufficient_quota", status=HTTPStatus.TOO_MANY_REQUESTS
            )
        return JSONResponse(obj)

    @router.get("/v1/files")
    async def list_files(
        request: Request, purpose: str | None = None, limit: int = 10000, after: str | None = None
    ) -> Any:
        if (error := disabled()) is not None or manager is None:
            return error
        viewer = _viewer(request)
        files = [
            f
            for f in map(lambda i: manager.file(i, viewer), list(manager.store.files))
            if f is not None and purpose in (None, f["purpose"])
        ]
        return JSONResponse(_page(files, limit, after))

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str) -> Any:
        if (error := disabled()) is not None or manager is None:
            return error
        file = manager.file(file_id, _viewer(request))
        return JSONResponse(file) if file else _not_found("File", file_id, "file_id")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> Any:
        if (error := disabled()) is not None or manager is None:
            return error
        if manager.file(file_id, _viewer(request)) is None or not await asyncio.to_thread(
            manager.store.delete_file, file_id
        ):
            return _not_found("File", file_id, "file_id")
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @router.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Any:
        if (error := disabled()) is not None or manager is None:
            return error
        if manager.file(file_id, _viewer(request)) is None:
            return _not_found("File", file_id, "file_id")
        try:
            data = await asyncio.to_thread(manager.store.read_file, file_id)
        except FileNotFoundError:  # deleted or swept meanwhile
            return _not_found("File", file_id, "file_id")
        return Response(data, media_type="application/octet-stream")

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> Any:
        if (error := disabled()) is not None or manager is None:
            return error
        try:
            body = await request.json()
        except ValueError:
            return error_response("The body must be a JSON object.")
        if not isinstance(body, dict):
            return error_response("The body must be a JSON object.")
        result = await manager.create(body, _viewer(request))
        return result if isinstance(result, JSONResponse) else JSONResponse(result)

    @router.get("/v1/batches")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> Any:
        if (error := disabled()) is not None or manager is None:
            return error
        return JSONResponse(_page(manager.all_batches(_viewer(request)), limit, after))

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str) -> Any:
        if (error := disabled()) is not None or manager is None:
            return error
        batch = manager.get(batch_id, _viewer(request))
        return JSONResponse(batch) if batch else _not_found("Batch", batch_id, "batch_id")

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> Any:
        if (error := disabled()) is not None or manager is None:
            return error
        result = await manager.cancel(batch_id, _viewer(request))
        return result if isinstance(result, JSONResponse) else JSONResponse(result)

    return router


def attach_batches(
    app: FastAPI,
    runner: BatchLineRunner,
    max_num_seqs: int,
    state_dir: str | None = None,
    max_concurrency: int | None = None,
    quota: FileQuota | None = None,
) -> BatchManager | None:
    """Add the batch routes to `app`, the manager starting and stopping with it; None (and
    503 routes) if another server holds the state directory."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--batch-max-concurrency must be at least 1, got {max_concurrency}.")
    root = os.path.abspath(os.path.expanduser(state_dir or default_state_dir()))
    try:
        lock = _StateDirLock(root)
    except BlockingIOError:
        message = (
            f"The batch state directory {root} is in use by another server; start this one "
            "with its own --batch-state-dir to use /v1/files and /v1/batches."
        )
        logger.warning(message)
        app.include_router(build_router(None, message))
        return None
    concurrency = max_concurrency if max_concurrency is not None else max(1, max_num_seqs // 2)
    manager = BatchManager(BatchStore(root), runner, concurrency, quota)
    app.state.batches = manager
    app.include_router(build_router(manager))

    async def stop() -> None:
        await manager.stop()
        lock.release()

    app.router.on_startup.append(manager.start)
    app.router.on_shutdown.append(stop)
    return manager
