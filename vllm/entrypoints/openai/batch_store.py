"""The files and batch jobs of `/v1/files` and `/v1/batches`, kept on disk so a restarted
server finds them (`--batch-state-dir`).

Layout under the state directory:

    files/<file_id>.json          the FileObject (metadata), plus `_owner`
    files/<file_id>.data          its bytes
    batches/<batch_id>.json       the Batch object (status, timestamps, counts, ...), plus
                                  `_owner`
    batches/<batch_id>.input      the input lines, copied when the batch is created
    batches/<batch_id>.results    the journal: one JSON line `{"line": i, "output": {...}}` per
                                  finished input line, appended and fsync'd before the line is
                                  counted

`_owner` is the id of the API key that created the object (`api_key_id`), None when the server
had no key; it stays on disk and out of the objects the API returns (`owners`).

Whole files are written atomically (a temporary file, fsync, rename, fsync of the directory),
so a crash leaves the old or the new version, never a torn one. The journal is the one file
appended to: a crash (SIGKILL, power loss) can leave its last record torn. Opening the store
repairs every journal, cutting it back to its longest prefix of complete, valid records (and
fsyncing the cut) before anything is appended, so a new record never lands after a fragment and
the torn line simply runs again.

Why a repaired JSON-lines journal rather than SQLite: the journal is append-only with one
writer (the state directory is locked by one server), so the only damage a crash can do is a
torn tail, and cutting it is a few lines that keep today's on-disk format (a state directory
written by an older server resumes as is). SQLite in WAL mode would give the same guarantee
for a whole rewrite of the store and a schema migration, and would not remove the atomic writes
of the metadata and file bytes.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from vllm import envs
from vllm.entrypoints.openai.protocol import random_uuid
from vllm.logger import init_logger

logger = init_logger("vllm.entrypoints.openai.batch_store")

_OWNER = "_owner"  # the on-disk field of an object's owner (never returned by the API)


def default_state_dir() -> str:
    """`$VLLM_PP_CACHE_DIR/batches`, by default ~/.cache/vllm-pp/batches."""
    root = envs.get_str("VLLM_PP_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-pp"
    )
    return os.path.join(root, "batches")


def write_atomic(path: str, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves either version whole."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _parse_record(raw: bytes) -> tuple[int, dict[str, Any]] | None:
    """(line, output) of one journal record with its newline, or None if it is not whole."""
    if not raw.endswith(b"\n"):
        return None
    try:
        entry = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("output"), dict):
        return None
    line = entry.get("line")
    if not isinstance(line, int) or isinstance(line, bool) or line < 0:
        return None
    return line, entry["output"]


def read_journal(path: str) -> tuple[dict[int, dict[str, Any]], int, int]:
    """The journal's records (input line -> its first recorded output), the length in bytes of
    its longest prefix of valid records, and its whole length. Reading stops at the first
    record that is not whole: anything after it was written after a crash it survived."""
    results: dict[int, dict[str, Any]] = {}
    valid = 0
    with open(path, "rb") as f:
        for raw in f:
            record = _parse_record(raw)
            if record is None:
                break
            results.setdefault(record[0], record[1])
            valid += len(raw)
        f.seek(0, os.SEEK_END)
        size = f.tell()
    return results, valid, size


def repair_journal(path: str) -> int:
    """Cut a journal back to its valid prefix (durably); the number of bytes cut."""
    _, valid, size = read_journal(path)
    if valid == size:
        return 0
    with open(path, "r+b") as f:
        f.truncate(valid)
        f.flush()
        os.fsync(f.fileno())
    logger.warning(
        "Batch journal %s: cut %d bytes after its last complete record (a crash mid-write); "
        "the line it held runs again",
        path,
        size - valid,
    )
    return size - valid


@dataclass(frozen=True)
class FileQuota:
    """What one API key (or, without keys, the whole server) may keep in uploaded files."""

    max_files: int
    max_bytes: int

    def __post_init__(self) -> None:
        if self.max_files < 1:
            raise ValueError(f"--max-files-per-key must be at least 1, got {self.max_files}.")
        if self.max_bytes < 1:
            raise ValueError(f"--max-file-bytes-per-key must be at least 1, got {self.max_bytes}.")


class QuotaExceededError(Exception):
    """An upload that would pass its owner's FileQuota (the message names the limit)."""


class BatchStore:
    """Files and batches under one directory; thread-safe (the handlers call it from worker
    threads so that fsync never blocks the event loop)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.files_dir = os.path.join(self.root, "files")
        self.batches_dir = os.path.join(self.root, "batches")
        os.makedirs(self.files_dir, exist_ok=True)
        os.makedirs(self.batches_dir, exist_ok=True)
        self._lock = threading.Lock()
        # Object id -> the id of the key that created it (None: created without keys).
        self.owners: dict[str, str | None] = {}
        self.files: dict[str, dict[str, Any]] = self._load(self.files_dir)
        self.batches: dict[str, dict[str, Any]] = self._load(self.batches_dir)
        for name in os.listdir(self.batches_dir):
            if name.endswith(".results"):
                repair_journal(os.path.join(self.batches_dir, name))
        for directory in (self.files_dir, self.batches_dir):  # a crash's half-written copies
            for name in os.listdir(directory):
                if name.startswith(".tmp-"):
                    os.unlink(os.path.join(directory, name))

    def _load(self, directory: str) -> dict[str, dict[str, Any]]:
        objects = {}
        for name in os.listdir(directory):
            if name.endswith(".json") and not name.startswith("."):
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    obj = json.load(f)
                self.owners[obj["id"]] = obj.pop(_OWNER, None)
                objects[obj["id"]] = obj
        return objects

    def _write_meta(self, directory: str, obj: dict[str, Any]) -> None:
        record = {**obj, _OWNER: self.owners.get(obj["id"])}
        write_atomic(self._meta_path(directory, obj["id"]), json.dumps(record).encode())

    # -- files --------------------------------------------------------------------------------

    def data_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, f"{file_id}.data")

    def add_file(
        self,
        data: bytes,
        filename: str,
        purpose: str,
        file_id: str | None = None,
        owner: str | None = None,
        expires_at: int | None = None,
        quota: FileQuota | None = None,
    ) -> dict[str, Any]:
        """Store a file (its bytes first, then its metadata: a file listed is whole). A given
        `file_id` (a batch's output) is overwritten, so writing it twice is harmless. With
        `quota`, QuotaExceededError if `owner`'s live files would pass it."""
        file_id = file_id or f"file-{random_uuid()}"
        now = int(time.time())
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": len(data),
            "created_at": now,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": expires_at,
        }
        with self._lock:
            if quota is not None:
                self._check_quota(owner, len(data), quota, now)
            self.owners[file_id] = owner
            write_atomic(self.data_path(file_id), data)
            self._write_meta(self.files_dir, obj)
            self.files[file_id] = obj
        return obj

    def _check_quota(self, owner: str | None, size: int, quota: FileQuota, now: float) -> None:
        mine = [
            f
            for file_id, f in self.files.items()
            if self.owners.get(file_id) == owner and f["purpose"] == "batch" and not expired(f, now)
        ]
        if len(mine) + 1 > quota.max_files:
            raise QuotaExceededError(
                f"File quota exceeded: this API key already has {len(mine)} files, the limit "
                f"is {quota.max_files} (--max-files-per-key). Delete files to upload more."
            )
        used = sum(int(f["bytes"]) for f in mine)
        if used + size > quota.max_bytes:
            raise QuotaExceededError(
                f"File quota exceeded: this API key's files take {used} bytes, this one "
                f"{size} more, the limit is {quota.max_bytes} bytes "
                "(--max-file-bytes-per-key). Delete files to upload more."
            )

    def live_file(self, file_id: str, now: float | None = None) -> dict[str, Any] | None:
        """The file's object, or None if there is none or it has expired (whether or not the
        sweep has removed it yet)."""
        file = self.files.get(file_id)
        if file is None or expired(file, time.time() if now is None else now):
            return None
        return file

    def read_file(self, file_id: str) -> bytes:
        with open(self.data_path(file_id), "rb") as f:
            return f.read()

    def delete_file(self, file_id: str) -> bool:
        with self._lock:
            return self._delete_file(file_id)

    def _delete_file(self, file_id: str) -> bool:
        if self.files.pop(file_id, None) is None:
            return False
        self.owners.pop(file_id, None)
        # The metadata first: a crash between the two leaves bytes no listing shows, never a
        # listed file without bytes; `sweep` removes such leftovers.
        os.unlink(self._meta_path(self.files_dir, file_id))
        if os.path.exists(self.data_path(file_id)):
            os.unlink(self.data_path(file_id))
        return True

    def sweep(self, now: float | None = None) -> list[str]:
        """Remove from disk every expired file (uploads and batch outputs alike) and the bytes
        a crash left without metadata; the ids of the files removed."""
        now = time.time() if now is None else now
        with self._lock:
            gone = [i for i, f in self.files.items() if expired(f, now)]
            for file_id in gone:
                self._delete_file(file_id)
            for name in os.listdir(self.files_dir):
                stem, ext = os.path.splitext(name)
                if ext == ".data" and stem not in self.files:
                    os.unlink(os.path.join(self.files_dir, name))
        if gone:
            logger.info("Removed %d expired file(s): %s", len(gone), ", ".join(gone))
        return gone

    # -- batches ------------------------------------------------------------------------------

    @staticmethod
    def _meta_path(directory: str, object_id: str) -> str:
        return os.path.join(directory, f"{object_id}.json")

    def input_path(self, batch_id: str) -> str:
        return os.path.join(self.batches_dir, f"{batch_id}.input")

    def results_path(self, batch_id: str) -> str:
        return os.path.join(self.batches_dir, f"{batch_id}.results")

    def create_batch(
        self, batch: dict[str, Any], input_data: bytes, owner: str | None = None
    ) -> None:
        """Record a new batch with its own copy of the input (deleting the uploaded file later
        does not break a batch that resumes after a restart)."""
        with self._lock:
            self.owners[batch["id"]] = owner
            write_atomic(self.input_path(batch["id"]), input_data)
            self._save_batch(batch)

    def save_batch(self, batch: dict[str, Any]) -> None:
        with self._lock:
            self._save_batch(batch)

    def _save_batch(self, batch: dict[str, Any]) -> None:
        self._write_meta(self.batches_dir, batch)
        self.batches[batch["id"]] = dict(batch)

    def read_input(self, batch_id: str) -> str:
        with open(self.input_path(batch_id), encoding="utf-8") as f:
            return f.read()

    def append_result(self, batch_id: str, line: int, output: dict[str, Any]) -> None:
        """Record input line `line`'s output durably (fsync) before it is counted. The journal
        was repaired when the store opened, so the record starts on a line of its own."""
        record = (json.dumps({"line": line, "output": output}) + "\n").encode()
        path = self.results_path(batch_id)
        with self._lock:
            created = not os.path.exists(path)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = os.lseek(fd, 0, os.SEEK_END)
                try:
                    view = memoryview(record)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                except OSError:
                    os.ftruncate(fd, start)  # a disk error mid-write: leave no fragment
                    raise
            finally:
                os.close(fd)
            if created:  # the journal's directory entry survives a power loss too
                _fsync_dir(self.batches_dir)

    def load_results(self, batch_id: str) -> dict[int, dict[str, Any]]:
        """Input line -> its recorded output (a torn last record is not one)."""
        path = self.results_path(batch_id)
        if not os.path.exists(path):
            return {}
        return read_journal(path)[0]


def expired(obj: dict[str, Any], now: float) -> bool:
    """Whether a file object's `expires_at` has passed."""
    expires_at = obj.get("expires_at")
    return expires_at is not None and expires_at <= now
