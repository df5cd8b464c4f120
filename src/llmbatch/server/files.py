"""Files as OpenAI's API shows them: ids, objects, uploads with limits, and a batch's output
and error files made into files."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmbatch.server.db import Database
from llmbatch.server.storage import FileStore

NOT_RUN_CODES = ("batch_cancelled", "batch_expired")
CHUNK = 1 << 20


class UploadError(Exception):
    """An upload over a limit: HTTP ``status``, OpenAI error ``code``."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "expires_at": row["expires_at"], "filename": row["filename"], "purpose": row["purpose"],
            "status": row["status"], "status_details": None}


class LimitedReader:
    """The chunks of an upload, counted: refuses more than ``max_bytes`` bytes or
    ``max_lines`` lines (the upload is then discarded)."""

    def __init__(self, source: Any, max_bytes: int, max_lines: int):
        self.source = source
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self.bytes = 0
        self.lines = 0
        self.last = b"\n"

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.source.read(CHUNK):
            self.bytes += len(chunk)
            if self.bytes > self.max_bytes:
                raise UploadError(413, "file_too_large", f"the file is larger than {self.max_bytes:,} bytes "
                                                         "(the server's --max-file-bytes)")
            self.lines += chunk.count(b"\n")
            self.last = chunk[-1:]
            if self.lines > self.max_lines:
                raise UploadError(400, "too_many_lines", f"the file has more than {self.max_lines:,} lines "
                                                         "(the server's --max-lines)")
            yield chunk
        if self.bytes and self.last != b"\n":
            self.lines += 1


def store_upload(db: Database, store: FileStore, source: Any, filename: str, purpose: str, max_bytes: int,
                 max_lines: int) -> dict[str, Any]:
    """Store an uploaded file within the limits; returns its row."""
    file_id = new_id("file-")
    reader = LimitedReader(source, max_bytes, max_lines)
    store.write(file_id, iter(reader))
    row = {"id": file_id, "bytes": reader.bytes, "created_at": int(time.time()), "expires_at": None,
           "filename": filename, "purpose": purpose, "status": "processed", "lines": reader.lines}
    db.insert(db.files, row)
    return row


def _count(path: Path) -> tuple[int, int]:
    """(lines, lines that are real failures) of an output or error file."""
    lines = failed = 0
    if not path.exists():
        return 0, 0
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            lines += 1
            error = json.loads(raw).get("error")
            if error and error.get("code") not in NOT_RUN_CODES:
                failed += 1
    return lines, failed


def import_output(db: Database, store: FileStore, batch_id: str, output: Path, errors: Path) -> dict[str, Any]:
    """Make a batch's output and error files into files (purpose ``batch_output``; ids stable
    per batch, so doing it again after a crash changes nothing); returns the batch's fields."""
    fields: dict[str, Any] = {}
    done, _ = _count(output)
    err_lines, failed = _count(errors)
    for kind, path, lines in (("output", output, done), ("error", errors, err_lines)):
        if not lines:
            fields[f"{kind}_file_id"] = None
            continue
        file_id = "file-" + hashlib.blake2b(f"{batch_id}:{kind}".encode(), digest_size=12).hexdigest()
        if db.get(db.files, file_id) is None:
            store.put(str(path), file_id)
            db.insert(db.files, {"id": file_id, "bytes": path.stat().st_size, "created_at": int(time.time()),
                                 "expires_at": None, "filename": f"{batch_id}_{kind}.jsonl",
                                 "purpose": "batch_output", "status": "processed", "lines": lines})
        fields[f"{kind}_file_id"] = file_id
    fields.update(completed=done, failed=failed)
    return fields
