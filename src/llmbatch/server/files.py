"""Files as OpenAI's API shows them: ids, objects, uploads with limits, and a batch's output
and error files made into files."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
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


class LineCounter:
    """The lines of an upload as its chunks arrive: refuses more than ``max_lines``."""

    def __init__(self, max_lines: int):
        self.max_lines = max_lines
        self.lines = 0
        self.last = b"\n"

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        self.lines += chunk.count(b"\n")
        self.last = chunk[-1:]
        if self.lines > self.max_lines:
            raise UploadError(400, "too_many_lines", f"the file has more than {self.max_lines:,} lines "
                                                     "(the server's --max-lines)")

    def total(self, size: int) -> int:
        """Lines, counting a last line with no newline."""
        return self.lines + (1 if size and self.last != b"\n" else 0)


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


def import_output(db: Database, store: FileStore, batch: dict[str, Any], output: Path, errors: Path) -> dict[str, Any]:
    """Make a batch's output and error files into files of its tenant (purpose ``batch_output``;
    ids stable per batch, so doing it again after a crash changes nothing; they expire
    ``output_expires_s`` after they are made, if the batch asked); returns the batch's fields."""
    batch_id = batch["id"]
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
            now = int(time.time())
            ttl = batch.get("output_expires_s")
            db.insert(db.files, {"id": file_id, "bytes": path.stat().st_size, "created_at": now,
                                 "expires_at": now + ttl if ttl else None, "filename": f"{batch_id}_{kind}.jsonl",
                                 "tenant": batch.get("tenant"),
                                 "purpose": "batch_output", "status": "processed", "lines": lines})
        fields[f"{kind}_file_id"] = file_id
    fields.update(completed=done, failed=failed)
    return fields
