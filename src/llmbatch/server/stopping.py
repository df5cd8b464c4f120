"""Stopping batch jobs: signals go to a job's whole process group (the job process and what
it started: its engine, its local Ray), SIGTERM first (the job commits what it answered), then
SIGKILL after a grace; and the error file of a batch stopped before its job read the input
(every request a ``batch_cancelled`` / ``batch_expired`` line, as OpenAI writes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from llmbatch.openai.responses import error_line


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (started with ``start_new_session``)
    while ``proc`` has not been reaped (its pid, the group's id, cannot have been reused)."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_step(proc: subprocess.Popen, grace_s: float) -> None:
    """One look at a job that was asked to stop: SIGTERM the first time, SIGKILL to its group
    once ``grace_s`` has passed since (a job stuck in start-up or in a long engine call)."""
    if proc.poll() is not None:
        return
    asked = getattr(proc, "llmbatch_stop_at", None)
    if asked is None:
        signal_group(proc, signal.SIGTERM)
        proc.llmbatch_stop_at = time.monotonic()
    elif time.monotonic() - asked >= grace_s and not getattr(proc, "llmbatch_killed", False):
        signal_group(proc, signal.SIGKILL)
        proc.llmbatch_killed = True


def stop_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every live job's group, wait up to ``timeout`` seconds, SIGKILL the groups left."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in live:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=10)


def write_not_run(source: IO[bytes], path: Path, key: str, code: str, message: str) -> int:
    """The error file of a batch whose job never read its input: one ``code`` line per request
    of ``source`` (lines that are not JSON objects with a custom_id have no request to name
    and are left out); returns the lines written."""
    written = 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as out:
        for number, raw in enumerate(source, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            if not isinstance(record, dict) or record.get("custom_id") is None:
                continue
            out.write(json.dumps(error_line(key, record["custom_id"], number, code, message)) + "\n")
            written += 1
    os.replace(tmp, path)
    return written
