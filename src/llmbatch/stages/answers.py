"""Answers a job already has, kept across restarts.

Within a run the engine stage sends identical deterministic requests once (``dedup``); its
memory of answers dies with the process. A job keeps them: the row whose request reached the
engine carries an answer record (:data:`~llmbatch.rows.ANSWER`: the request's digest, the
engine settings' tag and the engine's answer, as JSON text), committed with the row in its part.
The engine stage also appends each record, the moment the engine gives the answer, to the job's
answer journal (``JobDir.journal_dir``, one file per replica, a line per answer), so the answers
a kill catches between the engine and a commit (in a batch not yet finished, on their way to
the driver, in the driver's buffer) are kept too; a line cut short by the kill is skipped. When
the job resumes (or retries its error rows), the driver reads the records of its committed rows
and its journal back (``committed_answers``) and the engine stage copies those answers to
identical requests instead of sending them again: a kill costs the requests inside the engine.
The journal goes when the job finishes (its answers are all in committed rows then), and is
bounded while it runs: a replica keeps its current file and the one before
(:data:`JOURNAL_FILE_BYTES` each), dropping the older as a third begins: those answers were
committed long before.

A record counts only under the settings it was made with: the driver tags a run's records with a
digest of the job's model settings and reads back only records with the current tag, so a
``retry-errors --set model...`` recomputes. Answers that are not plain JSON (an embedding as an
array) or larger than :data:`MAX_ANSWER_BYTES` are not recorded; they are recomputed.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
import weakref
from typing import Any

#: the largest answer a row records (bigger answers are recomputed on resume)
MAX_ANSWER_BYTES = 64 << 10

#: Bytes of one answer-journal file: a replica keeps its current file and the one before, and
#: drops the older when a third begins (its answers were committed long before: a commit follows
#: its answers by seconds), so a replica's journal holds at most twice this.
JOURNAL_FILE_BYTES = 64 << 20


def answer_record(tag: str, key: bytes, result: dict[str, Any]) -> str | None:
    """The record of ``result``, the engine's answer to the request with digest ``key``; None
    where it cannot be recorded."""
    try:  # the prompt is the row's own already (and can be long)
        text = json.dumps({k: v for k, v in result.items() if k != "prompt"}, separators=(",", ":"), allow_nan=True)
    except (TypeError, ValueError):
        return None
    if len(text) > MAX_ANSWER_BYTES:
        return None
    return f'{{"e":{json.dumps(tag)},"k":"{key.hex()}","a":{text}}}'


def read_record(text: str, tag: str) -> tuple[bytes, dict[str, Any]] | None:
    """``(digest, answer)`` of a record made under ``tag``; None for another tag or a damaged one."""
    try:
        record = json.loads(text)
        if record.get("e") != tag or not isinstance(record.get("a"), dict):
            return None
        return bytes.fromhex(record["k"]), record["a"]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def load_known(source: Any) -> dict[bytes, dict[str, Any]]:
    """The known answers a stage was given: a dict, a Ray object holding one, or None."""
    if source is None:
        return {}
    if isinstance(source, dict):
        return source
    import ray

    return ray.get(source)


class AppendFile:
    """A file of its own in ``folder`` that this process appends to (closed when dropped)."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = 0
        self.close = weakref.finalize(self, os.close, self.fd)

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)
        self.size += len(data)


class Journal:
    """One replica's answer journal in ``folder``: a record a line, a new file past
    :data:`JOURNAL_FILE_BYTES`, the one before the last dropped as it begins."""

    def __init__(self, folder: str):
        self.folder = folder
        self.file = AppendFile(folder)
        self.before = ""  # the file before the current one

    def append(self, record: str) -> None:
        self.file.write((record + "\n").encode())
        if self.file.size < JOURNAL_FILE_BYTES:
            return
        dropped, self.before = self.before, self.file.path
        self.file.close()
        self.file = AppendFile(self.folder)
        if dropped:
            with contextlib.suppress(OSError):
                os.unlink(dropped)
