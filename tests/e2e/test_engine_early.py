"""The engine a job's driver launches before Ray and the replica (engines/vllm_early.py), end to
end: the real CLI in a real process on the real engine and Ray; the replica attaches to the
launched engine, and when that engine dies mid-run it starts its own and no row is lost.

On by default only on machines of 8+ CPUs: here forced with ``LLMBATCH_ENGINE_EARLY=1``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from own_cluster import command_line
from waiting import committed, wait_for

from llmbatch.jobs.store import JobDir

pytestmark = pytest.mark.e2e
#: an engine start takes a minute on a quiet machine, several beside the suite's other file
BOUND_S = 900
ROWS = 48

HOOKS = """
def request(row):
    # the last half of the rows write longer answers: the job is still running after 16 rows
    tokens = 40 if int(row["Index"]) > 24 else 12
    return {"messages": [{"role": "user", "content": f"Write a note for {row['Company']}."}],
            "sampling_params": {"temperature": 0, "ignore_eos": True, "max_tokens": tokens}}
"""


def expected_tokens(index: int) -> int:
    return 40 if index > 24 else 12


def write_job(tmp_path: Path) -> tuple[Path, Path]:
    from llmbatch.sample_data import write_customers_csv

    write_customers_csv(tmp_path / "customers.csv", ROWS, seed=5)
    (tmp_path / "hooks.py").write_text(HOOKS)
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""
        input: {path: customers.csv, id_column: Index}
        model:
          source: smollm2-135m-instruct
          engine_kwargs: {max_model_len: 512}
          batch_size: 8
          max_concurrent_batches: 2
          keep_warm_s: 0
        preprocess: hooks:request
        output: {path: out/notes.parquet, columns: [Index, generated_text, num_generated_tokens]}
        commit_rows: 1000
        commit_seconds: 1
    """))
    return job, tmp_path / "out" / "notes.parquet.job"


def below(proc: psutil.Process, text: str) -> list[psutil.Process]:
    try:
        return [p for p in proc.children(recursive=True) if text in command_line(p)]
    except psutil.Error:
        return []


def launcher_of(driver: subprocess.Popen) -> psutil.Process | None:
    """The driver's engine launcher (``python -m llmbatch.engines.vllm_launcher FOLDER``)."""
    found = below(psutil.Process(driver.pid), "llmbatch.engines.vllm_launcher")
    return found[0] if found else None


def job_replica(job_dir: Path) -> psutil.Process | None:
    """The replica the running job's progress.json names (``host:pid``)."""
    try:
        names = json.loads(JobDir(job_dir).progress_path.read_text()).get("replicas", {})
    except (OSError, ValueError):
        return None
    for name in names:
        host, _, pid = name.rpartition(":")
        if host == os.uname().nodename and pid.isdigit() and psutil.pid_exists(int(pid)):
            return psutil.Process(int(pid))
    return None


def test_replica_attaches_to_the_launched_engine_and_outlives_its_death(ray_cluster, smollm2, tmp_path):
    job_file, job_dir = write_job(tmp_path)
    log = tmp_path / "driver.log"
    with open(log, "ab") as fh:
        p = subprocess.Popen([sys.executable, "-m", "llmbatch", "run", str(job_file), "--quiet"], stdout=fh,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "LLMBATCH_ENGINE_EARLY": "1"})
    try:
        found: dict = {}

        def seen(key: str, look) -> bool:
            found[key] = look()
            return found[key] is not None

        wait_for(lambda: seen("launcher", lambda: launcher_of(p)), 120, "the driver's engine launcher", p, step=0.2)
        launcher = found["launcher"]
        folder = Path(launcher.cmdline()[-1])  # its folder: the attach file, its log
        wait_for(lambda: committed(job_dir) >= 16, BOUND_S, "the first 16 rows", p, step=0.5)
        engines = below(launcher, "VLLM::EngineCore")
        assert len(engines) == 1, f"the launcher should hold the job's engine: {engines}"
        wait_for(lambda: seen("replica", lambda: job_replica(job_dir)), 60, "the replica named in progress.json",
                 p, step=0.2)
        assert below(found["replica"], "VLLM::EngineCore") == [], "the replica should have attached, not started its own"
        assert committed(job_dir) < ROWS, "the job should still be running when its engine dies"
        engines[0].send_signal(signal.SIGKILL)  # the attached engine dies mid-run
        assert p.wait(timeout=BOUND_S) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)

    stats = json.loads((job_dir / "stats.json").read_text())
    table = pq.read_table(stats["output"]).to_pylist()
    ids = sorted(int(r["Index"]) for r in table)
    assert ids == list(range(1, ROWS + 1)), "every row once"
    assert (job_dir / "errors.jsonl").read_text() == ""
    wrong = [(r["Index"], r["num_generated_tokens"]) for r in table
             if r["num_generated_tokens"] != expected_tokens(int(r["Index"])) or not r["generated_text"]]
    assert not wrong, f"rows answered with other sampling settings than their own: {wrong[:5]}"
    assert stats["engine_restarts"] >= 1, "the replica should have started its own engine after the kill"
    # the launcher ends with the job (its lifeline is the driver's pipe), its folder with it
    wait_for(lambda: not launcher.is_running() or launcher.status() == psutil.STATUS_ZOMBIE, 60,
             "the launcher to end after the job")
    assert not folder.exists(), f"the launcher left its folder behind: {folder}"
