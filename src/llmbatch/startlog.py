"""The start-up ledger: JSON lines of the expensive starts, where ``LLMBATCH_START_LOG`` says.

An engine start (import vLLM, fork its engine process, load the model, allocate the KV cache),
a local Ray start or a CLI process is where a short job's time goes. With
``LLMBATCH_START_LOG=/path/file.jsonl`` in the environment, every such start in every process
that inherits it (the CLI, its Ray workers, the engine replicas) appends a line when it begins
(``{"kind", "t0", "pid", "phase": "begin", ...}``: a process killed in the middle still counts)
and one when it ends (``{"kind", "t0", "seconds", "ok", "pid", ...}``). The test suite counts
its engine starts with it; a user can count a pipeline's. Nothing is written when the variable
is unset.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

ENV = "LLMBATCH_START_LOG"


def record(kind: str, t0: float, seconds: float | None, ok: bool = True, **fields: Any) -> None:
    """Append one line for a start of ``kind`` that began at ``t0`` (epoch seconds); ``seconds``
    None: the line of its beginning."""
    path = os.environ.get(ENV)
    if not path:
        return
    entry: dict[str, Any] = {"kind": kind, "t0": round(t0, 3), "pid": os.getpid()}
    entry.update({"phase": "begin"} if seconds is None else {"seconds": round(seconds, 3), "ok": ok})
    line = json.dumps({**entry, **fields}, default=str) + "\n"
    try:  # one write on an O_APPEND descriptor: lines from many processes never interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a diagnostic: never a reason to fail the start it describes


@contextlib.contextmanager
def timed(kind: str, since: float | None = None, **fields: Any) -> Iterator[dict[str, Any]]:
    """Record the block as a start of ``kind`` (``ok`` false where it raised); the caller may
    add fields to the yielded dict. ``since``: the start began earlier, at this epoch time (its
    first steps ran before the block)."""
    t0, start = time.time(), time.perf_counter()
    if since is not None and since <= t0:
        t0, start = since, start - (t0 - since)
    extra: dict[str, Any] = dict(fields)
    record(kind, t0, None, **extra)
    ok = False
    try:
        yield extra
        ok = True
    except SystemExit as exc:  # a command line's end: ok where it exits 0 (typer always exits)
        ok = exc.code in (0, None)
        raise
    finally:
        record(kind, t0, time.perf_counter() - start, ok, **extra)
