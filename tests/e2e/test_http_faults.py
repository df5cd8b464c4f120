"""Jobs against a fault-injecting OpenAI-compatible server on loopback (no engine needed).

2,000 rows; on their first attempt many rows meet a fault (429 with and without Retry-After,
500/502/503, an answer slower than the timeout, a dropped connection, a body that is not JSON,
a truncated body), a few fail on every attempt (a 400 for one payload, a 500, a timeout, a
dropped connection). Every row is answered or is an error row with its reason; the server
counts requests and tokens and never sees its limits exceeded; a SIGKILL of the driver and
`resume` keep every id exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fake_openai import post, stats
from inproc import llmbatch
from waiting import committed, wait_for

from llmbatch.jobs.store import JobDir

pytestmark = pytest.mark.e2e

ROWS = 2000
QPS = 300
TPM = 480_000
TOKEN_WINDOW_S = 10
KEY = "sk-fake-key-for-the-fault-test-0123456789"
TRANSIENT = ["429", "429ra", "500", "502", "503", "slow", "drop", "badjson", "truncated"]
#: rows that fail on every attempt, and the error each must end with
ALWAYS = {777: ("bad400", "HttpStatusError", "HTTP 400 Bad Request: {\"error\": {\"message\": \"this payload is not acceptable"),
          1234: ("always500", "HttpStatusError", "HTTP 500 Internal Server Error"),
          1500: ("alwaysslow", "EndpointTimeoutError", "no complete answer within request_timeout_s=1 s"),
          1600: ("alwaysdrop", "EndpointConnectionError", "after 4 attempts")}


def cli(*args: str, log: Path) -> subprocess.Popen:
    fh = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "llmbatch", *args], stdout=fh, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def fault_of(index: int) -> str:
    if index in ALWAYS:
        return ALWAYS[index][0]
    k = index % 20
    return TRANSIENT[k - 1] if 1 <= k <= len(TRANSIENT) else "none"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The fault server, in a process of its own."""
    work = tmp_path_factory.mktemp("fake-openai")
    port_file = work / "port"
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fake_openai.py")), "--port-file",
                             str(port_file), "--qps", str(QPS), "--tpm", str(TPM), "--token-window",
                             str(TOKEN_WINDOW_S), "--slow", "2.5", "--api-key", KEY], stdout=log, stderr=log)
    wait_for(port_file.exists, 30, "the fake server's port")
    url = f"http://127.0.0.1:{port_file.read_text()}"
    yield url
    proc.kill()
    proc.wait()


def write_job(tmp_path: Path, url: str) -> tuple[Path, Path]:
    lines = ["Index,Company,Fault"] + [f"{i},Company {i % 97},fault={fault_of(i)}" for i in range(1, ROWS + 1)]
    (tmp_path / "customers.csv").write_text("\n".join(lines) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        input: {{path: customers.csv, id_column: Index}}
        model:
          processor: http
          source: fake-model
          url: {url}/v1/chat/completions
          api_key_env: LLMBATCH_FAKE_KEY
          qps: {QPS}
          tokens_per_minute: {TPM}
          max_retries: 3
          base_retry_wait_time_in_s: 0.2
          request_timeout_s: 1
          concurrency: 2
          batch_size: 100
        prompt: {{user: "Customer {{Index}} of {{Company}}: which industry? {{Fault}}"}}
        sampling_params: {{temperature: 0, max_tokens: 12}}
        output: {{path: out/answers.parquet}}
        commit_seconds: 1
    """))
    return job, tmp_path / "out" / "answers.parquet.job"


def results(job_dir: Path) -> tuple[dict[int, str], dict[int, dict]]:
    stats_ = json.loads((job_dir / "stats.json").read_text())
    table = pq.read_table(stats_["output"])
    ok = dict(zip(table.column("Index").to_pylist(), table.column("generated_text").to_pylist()))
    errors = {}
    for line in (job_dir / "errors.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["id"] not in errors, f"id {record['id']} twice in errors.jsonl"
        errors[record["id"]] = record
    assert len(ok) == table.num_rows, "an id twice in the output"
    return ok, errors


def check_every_row(job_dir: Path) -> None:
    ok, errors = results(job_dir)
    assert sorted(list(ok) + list(errors)) == list(range(1, ROWS + 1)), "lost or duplicated rows"
    assert set(errors) == set(ALWAYS), {i: errors[i]["message"] for i in errors if i not in ALWAYS}
    for index, (_, error_type, message) in ALWAYS.items():
        record = errors[index]
        assert record["stage"] == "engine" and record["error_type"] == error_type, record
        assert message in record["message"], record
    for index in (1, 2, 6, 7, 9, 21, 1999):  # transient faults and plain rows: the server's answer
        assert ok[index] == f"answer to Customer {index} of Company {index % 97}: which industry? " \
                            f"fault={fault_of(index)}", ok[index]


def assert_no_secret(job_dir: Path) -> None:
    for path in job_dir.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".txt", ""):
            assert KEY not in path.read_text(errors="replace"), path


def test_every_row_answered_or_an_error_row_and_the_limits_hold(ray_cluster, server, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMBATCH_FAKE_KEY", KEY)
    post(server, "reset")
    job_file, job_dir = write_job(tmp_path, server)
    started = time.monotonic()
    # the CLI in this process (tests/inproc.py): what the job does, not its process (that is the
    # SIGKILL test's)
    proc = llmbatch("run", str(job_file), "--quiet")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    took = time.monotonic() - started
    check_every_row(job_dir)
    seen = stats(server)
    assert seen["auth_failures"] == 0
    assert seen["limit_429"] == 0, seen  # never over the provider's limits
    assert seen["max_requests_per_s"] <= QPS, seen
    assert seen["max_tokens_per_window"] <= TPM * TOKEN_WINDOW_S / 60, seen
    # the faults were met (and retried): the first attempt of 9 rows in 20 failed
    for status in ("429", "500", "502", "503", "dropped", "badjson", "truncated", "400"):
        assert seen["statuses"].get(status), (status, seen["statuses"])
    assert_no_secret(job_dir)
    job_stats = json.loads((job_dir / "stats.json").read_text())
    # the faults were retried, not looped: one more attempt for about each faulty first attempt (9
    # rows in 20; 4 attempts for the rows that always fail), nothing near a retry storm. (How fast
    # the limits let the rows go is a speed figure: bench/http_bench.py. A wall-clock bound here
    # failed twice on a loaded 2-core machine: 27.9 s of rows against 16.5 s on a quiet one.)
    attempts = sum(seen["statuses"].values())
    assert ROWS <= attempts < 2 * ROWS, (seen["statuses"], job_stats["phases_s"], took)
    assert job_stats["input_tokens"] > 0 and job_stats["errors_by_type"] == {
        "engine: HttpStatusError": 2, "engine: EndpointTimeoutError": 1, "engine: EndpointConnectionError": 1}


def test_sigkill_and_resume_keep_every_id_exactly_once(ray_cluster, server, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMBATCH_FAKE_KEY", KEY)
    post(server, "reset")
    job_file, job_dir = write_job(tmp_path, server)
    log = tmp_path / "driver.log"
    p = cli("run", str(job_file), "--quiet", log=log)
    wait_for(lambda: committed(job_dir) >= 500, 300, "500 committed rows", p)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    before = committed(job_dir)
    assert 500 <= before < ROWS, before
    p = cli("resume", str(job_dir), "--quiet", log=log)
    assert p.wait(timeout=900) == 0, log.read_text()[-3000:]
    check_every_row(job_dir)
    runs = JobDir(job_dir).meta().runs  # the killed run recorded nothing; the resume finished
    assert [(r["mode"], r["state"]) for r in runs] == [("resume", "finished")]
    assert_no_secret(job_dir)
    os.environ.pop("LLMBATCH_FAKE_KEY", None)


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """A plain server (no faults, no limits) that answers each request after 1 s."""
    work = tmp_path_factory.mktemp("slow-openai")
    port_file = work / "port"
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fake_openai.py")), "--port-file",
                             str(port_file), "--latency", "1.0"], stdout=log, stderr=log)
    wait_for(port_file.exists, 30, "the slow server's port")
    yield f"http://127.0.0.1:{port_file.read_text()}"
    proc.kill()
    proc.wait()


def test_a_one_block_input_fills_the_worker_with_batches_side_by_side(ray_cluster, slow_server):
    """Ray hands a small input over in one block; the processor re-blocks it so that one worker
    works on many batches at once (one block of 96 rows with batch_size 8 would otherwise be one
    task: 8 requests at a time)."""
    import ray

    from llmbatch import HttpRequestProcessorConfig, build_processor

    config = HttpRequestProcessorConfig(url=f"{slow_server}/v1/chat/completions", batch_size=8, concurrency=1,
                                        max_concurrent_requests=64)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(payload=dict(model="m", messages=[{"role": "user", "content": f"row {row['i']}"}],
                                                 max_tokens=4)),
        postprocess=lambda row: dict(i=row["i"], answer=row["http_response"]["choices"][0]["message"]["content"]))
    ds = ray.data.from_items([{"i": i} for i in range(96)], override_num_blocks=1)
    assert ds.materialize().num_blocks() == 1
    rows = processor(ds).take_all()
    assert sorted(r["i"] for r in rows) == list(range(96))
    assert all(r["answer"] == f"answer to row {r['i']}" for r in rows)
    assert stats(slow_server)["max_in_flight"] >= 32, stats(slow_server)
