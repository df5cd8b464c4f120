"""Jobs on a 3-node Ray cluster simulated on this machine (``ray.cluster_utils.Cluster``, run
by ``cluster_nodes.py`` in a process of its own).

The head has 1 CPU (the reads, the driver's tasks); two worker nodes have 2 CPUs each and the
HTTP stage's workers ask for 2 (``http_request_stage: {num_cpus: 2}``), so one endpoint worker
sits on each worker node and nowhere else. The engine is the fake OpenAI-compatible server on
loopback (no model load). A worker node removed mid-run, and a driver SIGKILLed and resumed
from another process joined to the same cluster, both end with every id exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from fake_openai import post, stats
from waiting import committed, wait_for

from llmbatch.jobs.store import JobDir

pytestmark = pytest.mark.e2e

ROWS = 240
LATENCY_S = 0.2
REQUESTS_PER_WORKER = 4  # ~2 x 4 / 0.2 = 40 rows/s: the run lasts long enough to lose a node in it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("fake-openai-nodes")
    port_file = work / "port"
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fake_openai.py")), "--port-file",
                             str(port_file), "--latency", str(LATENCY_S)], stdout=log, stderr=log)
    wait_for(port_file.exists, 30, "the fake server's port")
    yield f"http://127.0.0.1:{port_file.read_text()}"
    proc.kill()
    proc.wait()


class NodeCluster:
    """The 3-node cluster run by ``cluster_nodes.py`` in a process of its own."""

    def __init__(self, proc: subprocess.Popen, info: dict):
        self.proc = proc
        self.address = info["address"]
        self.raylets = info["raylets"]

    def remove(self, k: int) -> None:
        self.proc.stdin.write(f"remove {k}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "removed"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head (1 CPU) + two worker nodes (2 CPUs each), private to this module: its address file
    and sessions live in a temp dir of its own (RAY_TMPDIR), so no other Ray user on this
    machine finds it with ``ray.init()``; only its own processes are stopped at the end."""
    temp = tempfile.mkdtemp(prefix="lbn-", dir="/tmp")  # short: Ray's socket paths must fit
    env = {**os.environ, "RAY_TMPDIR": temp, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path_factory.mktemp("cluster") / "cluster.log", "wb")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cluster_nodes.py"))], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the cluster did not start: {log.name}"
        yield NodeCluster(proc, json.loads(line))
    finally:
        if proc.poll() is None:
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def write_job(tmp_path: Path, url: str) -> tuple[Path, Path]:
    lines = ["Index,Company"] + [f"{i},Company {i}" for i in range(1, ROWS + 1)]
    (tmp_path / "customers.csv").write_text("\n".join(lines) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        input: {{path: customers.csv, id_column: Index}}
        model:
          processor: http
          source: fake-model
          url: {url}/v1/chat/completions
          max_retries: 2
          base_retry_wait_time_in_s: 0.1
          request_timeout_s: 10
          concurrency: 2
          batch_size: 8
          max_concurrent_requests: {REQUESTS_PER_WORKER}
          stall_timeout_s: 120
          http_request_stage: {{num_cpus: 2}}
        prompt: {{user: "Customer {{Index}} of {{Company}}: which industry?"}}
        sampling_params: {{temperature: 0, max_tokens: 12}}
        output: {{path: out/answers.parquet}}
        commit_seconds: 0.5
    """))
    return job, tmp_path / "out" / "answers.parquet.job"


def cli(*args: str, log: Path, address: str) -> subprocess.Popen:
    fh = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "llmbatch", *args], stdout=fh, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": address},
                            start_new_session=True)


def check_every_id_once(job_dir: Path) -> None:
    job_stats = json.loads((job_dir / "stats.json").read_text())
    table = pq.read_table(job_stats["output"])
    ids = table.column("Index").to_pylist()
    errors = [json.loads(line) for line in (job_dir / "errors.jsonl").read_text().splitlines()]
    assert not errors, errors[:3]
    assert sorted(ids) == list(range(1, ROWS + 1)), "lost or duplicated rows"
    for i, text in zip(ids[:20], table.column("generated_text").to_pylist()[:20]):
        assert text == f"answer to Customer {i} of Company {i}: which industry?", (i, text)


def endpoint_workers(raylet_pid: int) -> list[psutil.Process]:
    """The Ray worker processes of the node of ``raylet_pid`` that host an actor of llmbatch's
    stage runner (their process title names the actor class)."""
    raylet = psutil.Process(raylet_pid)
    found = []
    for child in raylet.children(recursive=True):
        try:
            if "StageRunner" in " ".join(child.cmdline()) or "MapWorker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def test_a_killed_driver_resumes_from_another_process_on_the_same_cluster(cluster, server, tmp_path):
    c = cluster
    job_file, job_dir = write_job(tmp_path, server)
    log = tmp_path / "driver.log"
    p = cli("run", str(job_file), "--quiet", log=log, address=c.address)
    wait_for(lambda: committed(job_dir) >= 40, 180, "40 committed rows", p)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    before = committed(job_dir)
    assert 40 <= before < ROWS, before
    p = cli("resume", str(job_dir), "--quiet", log=log, address=c.address)
    assert p.wait(timeout=600) == 0, log.read_text()[-4000:]
    check_every_id_once(job_dir)
    runs = JobDir(job_dir).meta().runs  # the killed run recorded nothing; the resume finished
    assert [(r["mode"], r["state"]) for r in runs] == [("resume", "finished")]


def test_a_worker_node_removed_mid_run_loses_and_duplicates_nothing(cluster, server, tmp_path):
    c = cluster
    job_file, job_dir = write_job(tmp_path, server)
    post(server, "reset")
    log = tmp_path / "driver.log"
    p = cli("run", str(job_file), "--quiet", log=log, address=c.address)
    wait_for(lambda: committed(job_dir) >= 40, 180, "40 committed rows", p)
    # one endpoint worker on each worker node (the head's 1 CPU cannot hold one)
    assert all(endpoint_workers(r) for r in c.raylets), [endpoint_workers(r) for r in c.raylets]
    # the node goes while its worker holds requests: the server keeps every request until it is
    # gone, and more in flight than one worker may send means both workers' (once, a node removed
    # between its batches had none, and the re-asked rows this test is about were never asked)
    post(server, "hold")
    try:
        wait_for(lambda: stats(server)["in_flight"] > REQUESTS_PER_WORKER, 60,
                 f"more than {REQUESTS_PER_WORKER} requests held (both workers')", p)
        c.remove(1)
        removed_at, removed_t = committed(job_dir), time.monotonic()
    finally:
        post(server, "release")
    assert removed_at < ROWS - 80, f"the node went too late to matter ({removed_at} rows committed)"
    assert p.wait(timeout=600) == 0, log.read_text()[-4000:]
    print(f"node removed at {removed_at} rows committed; the job ended {time.monotonic() - removed_t:.1f} s later")
    check_every_id_once(job_dir)
    # the lost node had rows in flight: they were asked again, and are still in the output once
    seen = stats(server)
    assert seen["keys"] == ROWS and seen["attempts"] > ROWS, seen
