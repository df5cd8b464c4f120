"""engines/vllm_early.py without an engine: when the driver launches one, and how a replica
gives up on a launched engine it cannot use (stopping it first, so its own has the device).
The attach itself runs end to end in tests/e2e/test_engine_early.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from llmbatch.engines import vllm_early
from llmbatch.errors import ConfigError


def test_on_by_default_only_with_enough_cpus(monkeypatch):
    monkeypatch.delenv(vllm_early.ENV, raising=False)
    monkeypatch.setattr(vllm_early.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert not vllm_early._enabled(), "a 2-core laptop: the launcher's import would take Ray's cores"
    monkeypatch.setattr(vllm_early.os, "sched_getaffinity", lambda pid: set(range(vllm_early.MIN_CPUS)))
    assert vllm_early._enabled()
    monkeypatch.setenv(vllm_early.ENV, "0")
    assert not vllm_early._enabled()
    monkeypatch.setattr(vllm_early.os, "sched_getaffinity", lambda pid: set(range(2)))
    monkeypatch.setenv(vllm_early.ENV, "1")
    assert vllm_early._enabled()
    monkeypatch.setenv(vllm_early.ENV, "yes")
    with pytest.raises(ConfigError, match="LLMBATCH_ENGINE_EARLY='yes'.*use 1"):
        vllm_early._enabled()


def a_launcher(tmp_path, key: str = "k") -> tuple[subprocess.Popen, dict]:
    """A process standing in for a launcher whose engine is not ready (no attach file yet)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    return proc, {"attach": str(tmp_path / "attach.json"), "key": key, "host": socket.gethostname(),
                  "launcher": proc.pid, "log": str(tmp_path / "engine.log")}


def test_a_launched_engine_of_other_settings_is_stopped(tmp_path):
    proc, info = a_launcher(tmp_path, key="theirs")
    try:
        assert vllm_early.attach(info, "mine") is None
        assert proc.wait(timeout=30) is not None, "the launcher (and its engine) should be stopped"
    finally:
        proc.kill()


def test_a_launch_that_is_not_ready_in_time_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_early, "WAIT_S", 0.5)
    proc, info = a_launcher(tmp_path)
    try:
        began = time.monotonic()
        assert vllm_early.attach(info, "k") is None
        assert time.monotonic() - began < 20
        assert proc.wait(timeout=30) is not None
    finally:
        proc.kill()


def test_a_failed_launch_or_another_machine_leaves_the_replica_its_own(tmp_path):
    proc, info = a_launcher(tmp_path)
    try:
        (tmp_path / "attach.json").write_text(json.dumps({"error": "NotImplementedError: multimodal"}))
        assert vllm_early.attach(info, "k") is None
        assert vllm_early.attach({**info, "host": "another-machine"}, "k") is None
        assert vllm_early.attach(None, "k") is None
        assert proc.poll() is None, "nothing to stop: the launcher ends with the job"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_launcher_that_exited_without_an_engine(tmp_path):
    proc, info = a_launcher(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    assert vllm_early.attach(info, "k") is None


def test_nothing_launched_outside_a_job():
    assert vllm_early.launched() is None
