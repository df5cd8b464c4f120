"""Waiting on a job that runs in another process: every wait has a bound and says what it
waited for, and stops early when that process has died."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from llmbatch.jobs.store import JobDir


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before: {what}")
        time.sleep(step)
    raise AssertionError(f"timed out waiting for: {what}")


def committed(job_dir: Path) -> int:
    """Rows of the job at ``job_dir`` committed so far (0 before its input is staged)."""
    job = JobDir(job_dir)
    if not job.exists() or not job.meta().ingested:
        return 0
    return job.state().counts()["done"]
