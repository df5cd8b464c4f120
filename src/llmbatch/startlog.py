"""The start-up ledger: one JSON line per expensive start, where ``LLMBATCH_START_LOG`` says.

An engine start (import vLLM, fork its engine process, load the model, allocate the KV cache),
a local Ray start or a CLI process is where a short job's time goes. With
``LLMBATCH_START_LOG=/path/file.jsonl`` in the environment, every such start in every process
that inherits it (the CLI, its Ray workers, the engine replicas) appends one line:
``{"kind", "t0", "seconds", "ok", "pid", ...}``. The test suite counts its engine starts with
it; a user can count a pipeline's. Nothing is written when the variable is unset.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

ENV = "LLMBATCH_START_LOG"


def record(kind: str, t0: float, seconds: float, ok: bool = True, **fields: Any) -> None:
    """Append one line for a start of ``kind`` that began at ``t0`` (epoch seconds)."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"kind": kind, "t0": round(t0, 3), "seconds": round(seconds, 3), "ok": ok,
                       "pid": os.getpid(), **fields}, default=str) + "\n"
    try:  # one write on an O_APPEND descriptor: lines from many processes never interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a diagnostic: never a reason to fail the start it describes


@contextlib.contextmanager
def timed(kind: str, **fields: Any) -> Iterator[dict[str, Any]]:
    """Record the block as a start of ``kind`` (``ok`` false where it raised); the caller may
    add fields to the yielded dict."""
    t0, start = time.time(), time.perf_counter()
    extra: dict[str, Any] = dict(fields)
    ok = False
    try:
        yield extra
        ok = True
    finally:
        record(kind, t0, time.perf_counter() - start, ok, **extra)
