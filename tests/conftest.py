"""Shared fixtures: one Ray cluster for the whole session, the offline models, sample data."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import start_counts

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the test cluster is private to this machine: no token authentication between its processes
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# every engine of the suite (llmbatch's where engine_kwargs name no size, and the plain-vLLM
# references: tests/e2e/vllm_*reference.py, vllm serve) gets a 256 MiB CPU KV cache: a tiny model
# needs no more, llmbatch's default (15% of free memory, 3 GiB on a 24 GiB machine) costs about
# 3 s of an engine's start to allocate, and the warm engines of a worker share the memory
os.environ.setdefault("LLMBATCH_CPU_KV_CACHE_BYTES", str(256 << 20))
# engines stay loaded between the runs of a test worker (llmbatch.stages.warm): a run whose
# engine settings match an earlier run's on the worker's Ray cluster leases that engine instead
# of starting one (the drivers that tests start inherit this too). Tests of an engine's own
# start, death or processes set keep_warm_s=0.
os.environ.setdefault("LLMBATCH_KEEP_WARM_S", "1800")
# a worker goes back to a setting after files of other settings (the suite's usual engine after the
# tasks' pooling models, the VLMs, the LoRA engines): six idle engines of other settings stay loaded
# (llmbatch's default is three); memory still rules (stages/warm.py: none stays where the machine
# has less than 35% of its memory available)
os.environ.setdefault("LLMBATCH_WARM_IDLE_OTHERS", "6")
# a new warm host starts once a quarter of the memory is available (llmbatch's default, 35%, is
# 8.4 GB on this 24 GB machine: each worker could only stop its own cluster's hosts to make it,
# so the other worker's engines made it stop its most used one, then start it again; the suite's
# engines are a couple of GB each, and idle hosts still stop below 20% available)
os.environ.setdefault("LLMBATCH_WARM_ROOM_FRACTION", "0.25")
# the engine launched by a job's driver (on by default on 8+ CPUs) only where a test asks for it
os.environ.setdefault("LLMBATCH_ENGINE_EARLY", "0")

REPO = Path(__file__).resolve().parents[1]


def _engine_cores() -> None:
    """With two test files at a time (``make test TEST_WORKERS=2``) each worker's engines
    compute on their own cores: vLLM on CPU binds its compute threads to the first core by
    itself, so the two workers' engines would share one core and leave the other idle."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // max(count, 1)
    if not worker.startswith("gw") or count < 2 or share < 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    k = int(worker[2:]) % count
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores[k * share:(k + 1) * share])


_engine_cores()
start_counts.log_here()


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The default offline chat model, prepared (converted once into the cache)."""
    from llmbatch.models import prepare

    return str(prepare("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def minilm() -> str:
    from llmbatch.models import prepare

    return str(prepare("all-minilm-l6-v2"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A Ray head started once (real CPUs of this machine); drivers in subprocesses join it
    through RAY_ADDRESS, as on a real cluster."""
    import ray

    if ray.is_initialized():
        yield os.environ.get("RAY_ADDRESS")
        return
    # a short private temp dir (Ray's socket paths must fit in 107 bytes; pytest-xdist's are long)
    temp = Path(tempfile.mkdtemp(prefix="lbt-", dir="/tmp"))
    with socket.socket() as s:  # a free port: another test session may run a cluster beside this one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
           "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"]
    from llmbatch import startlog

    try:
        with startlog.timed("ray-cluster"):
            subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    except subprocess.CalledProcessError:
        _stop_own_cluster(temp, port)  # a head that failed half-way (its raylet died) leaves its GCS and monitors running
        shutil.rmtree(temp, ignore_errors=True)
        raise
    address = f"127.0.0.1:{port}"
    os.environ["RAY_ADDRESS"] = address
    os.environ["LLMBATCH_TEST_RAY_TEMP"] = str(temp)  # tests/e2e/own_cluster.py finds its processes by it
    ray.init(address=address, logging_level="WARNING")
    try:
        yield address
    finally:
        ray.shutdown()
        _stop_own_cluster(temp, port)
        os.environ.pop("RAY_ADDRESS", None)
        os.environ.pop("LLMBATCH_TEST_RAY_TEMP", None)
        shutil.rmtree(temp, ignore_errors=True)
        time.sleep(1)


def _stop_own_cluster(temp: Path, port: int) -> None:
    """Stop the Ray head this session started, and nothing else: ``ray stop`` would stop every
    Ray cluster on the machine (other sessions' included). Its processes name its temp dir; its
    workers exit with its raylet, but its agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``)
    rename themselves and outlived SIGTERM once: the named processes' descendants are ended too.
    Its Ray client server names neither the temp dir nor has a named parent (``python -m
    ray.util.client.server --address=<node ip>:<port> ...``, a child of init): found by the
    head's port, else every fresh clone's suite left one per worker running."""
    from llmbatch.reaper import end_processes, processes_naming, with_descendants

    own = [proc.pid for proc in processes_naming(f"{temp}/")]
    for proc in processes_naming("ray.util.client.server"):
        try:
            if any(arg.startswith("--address=") and arg.endswith(f":{port}") for arg in proc.cmdline()):
                own.append(proc.pid)
        except Exception:  # noqa: BLE001 - it exited meanwhile
            continue
    end_processes(with_descendants(own), grace_s=5)


@pytest.fixture(scope="session")
def customers_csv(tmp_path_factory) -> Path:
    from llmbatch.sample_data import write_customers_csv

    return write_customers_csv(tmp_path_factory.mktemp("data") / "customers.csv", 400, seed=7)


@pytest.fixture(scope="session")
def test_models(minilm, smollm2) -> dict:
    """The seeded test models (classifier, cross-encoder, reward model, LoRA adapters), built
    offline once into the cache (``llmbatch models make-test-models``)."""
    from llmbatch.toy_models import make_test_models

    return {name: str(path) for name, path in make_test_models().items()}



@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Longest files first, next file at a worker's last test (tests/suite_schedule.py)."""
    if config.getoption("dist") == "loadfile":
        from suite_schedule import LongestFilesFirst

        return LongestFilesFirst(config, log)
    return None


_file_seconds: dict[str, float] = {}
#: (worker, file, start, stop) of every test phase the session ran: the start-up ledger's lines
#: are put on the file that ran on their worker when they began
_phases: list[tuple[str, str, float, float]] = []


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else os.environ.get("PYTEST_XDIST_WORKER", "main")
    _phases.append((worker, path, report.start, report.stop))


def pytest_terminal_summary(terminalreporter):
    """Seconds per test file (setup, call and teardown), longest first: what
    tests/suite_schedule.py's LONGEST_FIRST is ordered by; and the suite's expensive starts."""
    if not _file_seconds:
        return
    terminalreporter.section("seconds per test file")
    for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
    from start_counts import START_DIR_ENV, count_starts, format_counts

    folder = os.environ.get(START_DIR_ENV)
    if folder and not os.environ.get("PYTEST_XDIST_WORKER"):
        terminalreporter.section("engine cold starts per test file (LLMBATCH_START_LOG)")
        for line in format_counts(count_starts(Path(folder), _phases, _file_seconds)):
            terminalreporter.write_line(line)
