"""The files and batch jobs of `/v1/files` and `/v1/batches`, kept on disk so a restarted
server finds them (`--batch-state-dir`).

Layout under the state directory:

    files/<file_id>.json          the FileObject (metadata)
    files/<file_id>.data          its bytes
    batches/<batch_id>.json       the Batch object (status, timestamps, counts, ...)
    batches/<batch_id>.input      the input lines, copied when the batch is created
    batches/<batch_id>.results    the journal: one JSON line `{"line": i, "output": {...}}` per
                                  finished input line, appended and fsync'd before the line is
                                  counted

Whole files are written atomically (a temporary file, fsync, rename, fsync of the directory),
so a crash leaves the old or the new version, never a torn one. A journal line torn by a crash
(no newline at its end) is ignored on reading: that line simply runs again.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from typing import Any

from vllm import envs
from vllm.entrypoints.openai.protocol import random_uuid


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
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
        self.files: dict[str, dict[str, Any]] = self._load(self.files_dir)
        self.batches: dict[str, dict[str, Any]] = self._load(self.batches_dir)

    @staticmethod
    def _load(directory: str) -> dict[str, dict[str, Any]]:
        objects = {}
        for name in os.listdir(directory):
            if name.endswith(".json") and not name.startswith("."):
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    obj = json.load(f)
                objects[obj["id"]] = obj
        return objects

    # -- files --------------------------------------------------------------------------------

    def data_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, f"{file_id}.data")

    def add_file(
        self, data: bytes, filename: str, purpose: str, file_id: str | None = None
    ) -> dict[str, Any]:
        """Store a file (its bytes first, then its metadata: a file listed is whole). A given
        `file_id` (a batch's output) is overwritten, so writing it twice is harmless."""
        file_id = file_id or f"file-{random_uuid()}"
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": len(data),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }
        with self._lock:
            write_atomic(self.data_path(file_id), data)
            write_atomic(self._meta_path(self.files_dir, file_id), json.dumps(obj).encode())
            self.files[file_id] = obj
        return obj

    def read_file(self, file_id: str) -> bytes:
        with open(self.data_path(file_id), "rb") as f:
            return f.read()

    def delete_file(self, file_id: str) -> bool:
        with self._lock:
            if self.files.pop(file_id, None) is None:
                return False
            os.unlink(self._meta_path(self.files_dir, file_id))
            os.unlink(self.data_path(file_id))
        return True

    # -- batches ------------------------------------------------------------------------------

    @staticmethod
    def _meta_path(directory: str, object_id: str) -> str:
        return os.path.join(directory, f"{object_id}.json")

    def input_path(self, batch_id: str) -> str:
        return os.path.join(self.batches_dir, f"{batch_id}.input")

    def results_path(self, batch_id: str) -> str:
        return os.path.join(self.batches_dir, f"{batch_id}.results")

    def create_batch(self, batch: dict[str, Any], input_data: bytes) -> None:
        """Record a new batch with its own copy of the input (deleting the uploaded file later
        does not break a batch that resumes after a restart)."""
        with self._lock:
            write_atomic(self.input_path(batch["id"]), input_data)
            self._save_batch(batch)

    def save_batch(self, batch: dict[str, Any]) -> None:
        with self._lock:
            self._save_batch(batch)

    def _save_batch(self, batch: dict[str, Any]) -> None:
        write_atomic(self._meta_path(self.batches_dir, batch["id"]), json.dumps(batch).encode())
        self.batches[batch["id"]] = dict(batch)

    def read_input(self, batch_id: str) -> str:
        with open(self.input_path(batch_id), encoding="utf-8") as f:
            return f.read()

    def append_result(self, batch_id: str, line: int, output: dict[str, Any]) -> None:
        """Record input line `line`'s output durably (fsync) before it is counted."""
        record = json.dumps({"line": line, "output": output}) + "\n"
        with self._lock:
            with open(self.results_path(batch_id), "a", encoding="utf-8") as f:
                f.write(record)
                f.flush()
                os.fsync(f.fileno())

    def load_results(self, batch_id: str) -> dict[int, dict[str, Any]]:
        """Input line -> its recorded output (a torn last record is ignored)."""
        results: dict[int, dict[str, Any]] = {}
        path = self.results_path(batch_id)
        if not os.path.exists(path):
            return results
        with open(path, encoding="utf-8") as f:
            for record in f:
                if not record.endswith("\n"):
                    break  # torn by a crash mid-write: that line runs again
                entry = json.loads(record)
                results.setdefault(int(entry["line"]), entry["output"])
        return results
