"""``RAY_ADDRESS``: a job submitted from another process runs on an existing cluster.

The cluster is the worker's session cluster (the ``ray_cluster`` fixture: ``ray start --head``
with a temp dir of its own, which ``LLMBATCH_TEST_RAY_TEMP`` names); ``llmbatch run`` runs in a
separate process with ``RAY_ADDRESS`` set. The driver must join that cluster (Ray records it
there as a driver with that process id) instead of starting a local Ray, and every id comes out
once. The engine is the fake OpenAI-compatible server on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from waiting import wait_for

pytestmark = pytest.mark.e2e

ROWS = 200


@pytest.fixture
def server(tmp_path):
    port_file = tmp_path / "port"
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fake_openai.py")), "--port-file",
                             str(port_file), "--latency", "0.05"], stdout=log, stderr=log)
    wait_for(port_file.exists, 30, "the fake server's port")
    yield f"http://127.0.0.1:{port_file.read_text()}"
    proc.kill()
    proc.wait()


def test_a_job_from_another_process_runs_on_the_cluster_at_ray_address(ray_cluster, server, tmp_path):
    temp = os.environ.get("LLMBATCH_TEST_RAY_TEMP")
    assert ray_cluster and temp, "this test needs the session cluster the ray_cluster fixture starts (its temp dir)"
    address, temp = ray_cluster, Path(temp)
    lines = ["Index,Company"] + [f"{i},Company {i}" for i in range(1, ROWS + 1)]
    (tmp_path / "customers.csv").write_text("\n".join(lines) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        input: {{path: customers.csv, id_column: Index}}
        model: {{processor: http, source: fake-model, url: {server}/v1/chat/completions, concurrency: 2,
                 batch_size: 16, max_retries: 1, request_timeout_s: 10}}
        prompt: {{user: "Customer {{Index}} of {{Company}}"}}
        sampling_params: {{temperature: 0, max_tokens: 8}}
        output: {{path: out/answers.parquet}}
    """))
    env = {**os.environ, "RAY_ADDRESS": address, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_TMPDIR", None)  # the driver finds the cluster through RAY_ADDRESS alone
    log = tmp_path / "driver.log"
    with open(log, "wb") as fh:
        p = subprocess.Popen([sys.executable, "-m", "llmbatch", "run", str(job), "--quiet"], stdout=fh,
                             stderr=subprocess.STDOUT, env=env)
        assert p.wait(timeout=900) == 0, log.read_text()[-4000:]
    # the cluster at RAY_ADDRESS saw this process as a driver (Ray names a driver's log after
    # its job id and process id), and it started no Ray of its own (a session dir ends with
    # the id of the process that started it)
    drivers = [f.name for f in temp.glob("session_*/logs/python-core-driver-*")]
    assert any(name.endswith(f"_{p.pid}.log") for name in drivers), (p.pid, drivers)
    assert not list(Path("/tmp/ray").glob(f"session_*_{p.pid}")), "the driver started a Ray of its own"
    stats = json.loads((tmp_path / "out" / "answers.parquet.job" / "stats.json").read_text())
    table = pq.read_table(stats["output"])
    assert sorted(table.column("Index").to_pylist()) == list(range(1, ROWS + 1))
    assert table.column("generated_text").to_pylist()[0].startswith("answer to Customer ")
