"""engines/vllm_early.py without an engine: when the driver launches one, and how a replica
gives up on a launched engine it cannot use (stopping it first, so its own has the device).
The attach itself runs end to end in tests/e2e/test_engine_early.py."""

from __future__ import annotations

import copy
import json
import os
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


def a_launcher(tmp_path, key: str = "k", code: str = "import time; time.sleep(300)") -> tuple[subprocess.Popen, dict]:
    """A process standing in for a launcher whose engine is not ready (no attach file yet)."""
    proc = subprocess.Popen([sys.executable, "-c", code])
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


def test_the_cli_starts_the_launcher_before_its_own_imports(monkeypatch):
    """``llmbatch run`` hands ``prewarm`` its arguments before it imports its commands (Ray,
    pyarrow, the config layer: ``cli._app``), and lets a launcher it did not use go as it ends.
    (That importing ``llmbatch.cli`` itself pulls in none of them: tests/test_public_api.py.)"""
    import llmbatch.cli as cli

    calls = []
    monkeypatch.delenv("LLMBATCH_START_LOG", raising=False)  # main() here is no CLI process to count
    # nor the test process llmbatch's own (a claimed process lends its terminal to every later job)
    monkeypatch.setattr(cli.terminal, "_own_process", cli.terminal._own_process)
    monkeypatch.setattr(vllm_early, "prewarm", lambda argv: calls.append(("prewarm", argv)))
    monkeypatch.setattr(vllm_early, "stop_all", lambda: calls.append(("stop_all",)))
    monkeypatch.setattr(cli, "_app", lambda: calls.append(("commands",)) or (lambda: calls.append(("ran",))))
    monkeypatch.setattr(sys, "argv", ["llmbatch", "run", "job.yaml"])
    cli.main()
    assert calls == [("prewarm", ["run", "job.yaml"]), ("commands",), ("ran",), ("stop_all",)]


def test_prewarm_only_for_a_jobs_commands_where_the_engine_is_launched_early(monkeypatch):
    spawned = []
    monkeypatch.setattr(vllm_early, "_spawn", lambda: spawned.append(1) or None)
    monkeypatch.setattr(vllm_early, "_one_device_here", lambda: True)
    monkeypatch.setenv(vllm_early.ENV, "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for argv in (["status", "d"], ["run", "--help"], ["serve"], []):
        vllm_early.prewarm(argv)
    monkeypatch.setenv("RAY_ADDRESS", "ray://10.0.0.5:10001")  # the replica may run on another machine
    vllm_early.prewarm(["run", "job.yaml"])
    monkeypatch.delenv("RAY_ADDRESS")
    for value in ("0", "yes"):  # off; a mistake the job's own check reports
        monkeypatch.setenv(vllm_early.ENV, value)
        vllm_early.prewarm(["run", "job.yaml"])
    assert spawned == []
    monkeypatch.setenv(vllm_early.ENV, "1")
    for command in vllm_early.PREWARM_COMMANDS:
        vllm_early.prewarm([command, "job"])
    assert len(spawned) == len(vllm_early.PREWARM_COMMANDS)


def test_a_launcher_not_given_a_spec_ends_mid_import_and_leaves_nothing(monkeypatch):
    """A job that needs no engine of its own (another engine kind, nothing left to do): the
    launcher started for it ends as soon as the driver lets go, whether or not vLLM's import is done."""
    monkeypatch.setenv(vllm_early.ENV, "1")
    monkeypatch.setattr(vllm_early, "_one_device_here", lambda: True)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    vllm_early.prewarm(["run", "job.yaml"])
    launcher = vllm_early._prewarmed
    assert launcher is not None and launcher.proc.poll() is None
    folder = launcher.attach_path.rsplit("/", 1)[0]
    vllm_early.stop_all()
    assert vllm_early._prewarmed is None
    assert launcher.proc.wait(timeout=60) == 0
    assert not __import__("os").path.exists(folder), "the launcher should remove its folder"


FORK_AFTER_SPEC = """
import multiprocessing, sys, tempfile
from llmbatch.engines.vllm_launcher import Stdin

stdin = Stdin(tempfile.mkdtemp())
assert stdin.has_spec.wait(30), "no spec"
child = multiprocessing.get_context("fork").Process(target=int)  # as vLLM starts a GPU engine
child.start()
child.join(20)
print("child exit", child.exitcode, flush=True)
if child.exitcode is None:
    child.kill()
"""


def test_a_process_the_launcher_forks_while_waiting_for_the_driver_starts():
    """The launcher forks vLLM's engine (on a GPU) while its stdin thread waits for the driver to
    let go. Reading Python's ``sys.stdin`` there held its buffer's lock, and the forked engine's
    first step (closing its stdin) waited for it for ever: a job on one H200 waited 455 s with the
    engine never started. The child must start and end."""
    proc = subprocess.Popen([sys.executable, "-c", FORK_AFTER_SPEC], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(json.dumps({"attach": "unused"}) + "\n")
        proc.stdin.flush()  # and kept open: the driver's job is still running
        out = proc.stdout.readline()  # the script's bounds: 30 s for the spec, 20 s for the child
        assert out.strip() == "child exit 0", f"the forked process did not run to its end: {out!r}"
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_launch_that_makes_no_progress_is_given_up_long_before_the_ready_bound(tmp_path, monkeypatch, caplog):
    """A launch that uses no CPU (deadlocked, as the engine forked beside a held stdin lock was on
    one H200) is stopped after STALL_S, not after vLLM's 600-s ready bound."""
    monkeypatch.setattr(vllm_early, "STALL_S", 1.0)
    proc, info = a_launcher(tmp_path)  # sleeps: no CPU
    try:
        began = time.monotonic()
        assert vllm_early.attach(info, "k") is None
        assert time.monotonic() - began < 20
        assert proc.wait(timeout=30) is not None, "the stalled launcher should be stopped"
        assert "made no progress" in caplog.text, caplog.text
    finally:
        proc.kill()


def test_a_launch_that_works_is_not_taken_for_a_stalled_one(tmp_path, monkeypatch, caplog):
    """A launcher busy at its start (here: a loop at one core) is waited for until the ready bound."""
    monkeypatch.setattr(vllm_early, "STALL_S", 1.0)
    monkeypatch.setattr(vllm_early, "WAIT_S", 3.0)
    proc, info = a_launcher(tmp_path, code="import time\nend = time.time() + 300\nwhile time.time() < end: pass")
    try:
        assert vllm_early.attach(info, "k") is None
        assert "not ready after" in caplog.text and "made no progress" not in caplog.text, caplog.text
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_the_front_end_gets_the_renderer_built_while_the_engine_started(smollm2):
    """``config_ahead`` loads the tokenizer while the launched engine starts; ``AsyncLLM``, built
    after the wait, must use that renderer, not load the tokenizer again (1.1 s of 1.25 s here)."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine import async_llm

    kwargs = {"model": smollm2, "max_model_len": 512, "enforce_eager": True, "gpu_memory_utilization": 0.3}
    info = {"host": socket.gethostname(), "key": "k"}
    assert vllm_early.config_ahead(info, "other settings", kwargs, UsageContext.LLM_CLASS) is None
    ahead = vllm_early.config_ahead(info, "k", kwargs, UsageContext.LLM_CLASS)
    assert ahead is not None, "the config and renderer should be built ahead for this replica's engine"
    _, config, renderer = ahead
    assert renderer.tokenizer is not None and renderer.tokenizer.encode("Acme Corp")
    own = async_llm.renderer_from_config
    with vllm_early.renderer_given(ahead):
        # what AsyncLLM.__init__ calls, by the name it calls it in its module
        assert async_llm.renderer_from_config(config) is renderer
        other = async_llm.renderer_from_config(copy.copy(config))
        assert other is not renderer, "another config gets a renderer of its own"
        other.shutdown()
    assert async_llm.renderer_from_config is own, "vLLM's factory should be back after the front-end is built"
    # a CPU engine's KV cache bytes follow the memory free when each process sized them (the
    # launcher's and the replica's differed by 5% here): the front-end built ahead is still the one
    assert vllm_early._same({**kwargs, "kv_cache_memory_bytes": 3324563865}) == \
        vllm_early._same({**kwargs, "kv_cache_memory_bytes": 3515190067})
    assert vllm_early._same({**kwargs, "max_model_len": 256}) != vllm_early._same(kwargs)
    renderer.shutdown()


def test_a_launch_that_fails_keeps_its_log_and_the_replica_names_it(caplog, monkeypatch):
    """The real launcher, handed a model it cannot start: the replica starts its own engine and
    its warning names the launcher's log, which holds the traceback and outlives the job."""
    import shutil

    from llmbatch.engines.settings import VLLMSettings

    monkeypatch.setattr(vllm_early, "_wanted", lambda settings: True)  # (Ray here, one replica: the job's)
    launch = vllm_early.launch(VLLMSettings(model_source="/nonexistent/llmbatch-test-model", engine_kwargs={}))
    assert launch is not None
    try:
        with caplog.at_level("WARNING", logger=vllm_early.__name__):
            assert vllm_early.attach(launch.info(), launch.key) is None, "a failed launch: the replica starts its own"
        assert f"its log: {launch.log_path}" in caplog.text, caplog.text
        vllm_early.stop_all()  # the job ends
        assert launch.proc.wait(timeout=60) == 0
        log = open(launch.log_path).read()
        assert "/nonexistent/llmbatch-test-model" in log and "Traceback" in log, log[-2000:]
        assert not os.path.exists(launch.attach_path)
    finally:
        vllm_early.stop_all()
        launch.proc.kill()
        launch.proc.wait(timeout=30)
        shutil.rmtree(os.path.dirname(launch.log_path), ignore_errors=True)
