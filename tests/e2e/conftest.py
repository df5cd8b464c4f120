"""End-to-end tests share one check: no engine process outlives the test session."""

from __future__ import annotations

import time

import psutil
import pytest


def _orphan_engines(since: float) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time", "ppid"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if cmd.startswith("VLLM::") and proc.info["create_time"] >= since and proc.info["ppid"] == 1:
            found.append(proc)
    return found


@pytest.fixture(scope="session", autouse=True)
def no_engine_process_left_behind():
    """Engine processes whose replica is gone (orphans) must be gone too, once the session's
    Ray cluster has stopped: nothing keeps memory (or a GPU) after its job."""
    start = time.time()
    yield
    deadline = time.monotonic() + 20
    while _orphan_engines(start) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _orphan_engines(start)
    assert not left, f"engine processes left behind: {[(p.pid, p.info['cmdline']) for p in left]}"
