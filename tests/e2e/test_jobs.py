"""Jobs end to end: the real CLI in real processes, killed for real, on the real engine.

Drivers run as subprocesses (`python -m llmbatch ...`) that join the session's Ray cluster
through RAY_ADDRESS; killing a driver is what a crash of the machine running it looks like.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from inproc import llmbatch
from own_cluster import command_line
from waiting import committed, wait_for

from llmbatch.jobs.store import JobDir

pytestmark = pytest.mark.e2e
#: how long a step may wait for the driver it started: an engine start takes a minute when the
#: machine is quiet and several when the suite's other file loads both cores; only a hang gets here
BOUND_S = 900
#: how often a step looks at the job's committed rows: each look reads every part file, and at
#: 20 looks a second the test process took a sixth of a core from the engine it waits on
POLL_S = 0.5


HOOKS = """
def request(row):
    # the last rows of the input write much longer answers: they finish last, and the final
    # part of the job is still being made while every other row is committed
    # and the very last batch writes the longest: it is still running when the rest is committed
    index = int(row["Index"])
    tokens = LAST_TOKENS if index > LAST_AFTER else (50 if index > LONG_AFTER else 16)
    return {"messages": [{"role": "user", "content": f"Customer #{row['Index']}: write a welcome note for "
                                                     f"{row['First Name']} {row['Last Name']} of {row['Company']}."}],
            "sampling_params": {"temperature": 0, "ignore_eos": True, "max_tokens": tokens}}
"""


def write_job(tmp_path: Path, rows: int, *, long_tail: int = 20, keep_warm_s: float | None = None,
              last_tokens: int = 150) -> tuple[Path, Path]:
    from llmbatch.sample_data import write_customers_csv

    write_customers_csv(tmp_path / "customers.csv", rows, seed=11)
    (tmp_path / "hooks.py").write_text(f"LONG_AFTER = {rows - long_tail}\nLAST_AFTER = {rows - 8}\n"
                                       f"LAST_TOKENS = {last_tokens}\n" + HOOKS)
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""
        input: {path: customers.csv, id_column: Index}
        model:
          source: smollm2-135m-instruct
          engine_kwargs: {max_model_len: 512}
          batch_size: 8
          max_concurrent_batches: 2   # rows come back in waves (not all at once), so kills land mid-job
          {warm}
        preprocess: hooks:request
        output: {path: out/notes.parquet, columns: [Index, Company, generated_text, num_generated_tokens]}
        commit_rows: 1000
        commit_seconds: 1
    """).replace("{warm}", "" if keep_warm_s is None else f"keep_warm_s: {keep_warm_s}"))
    return job, tmp_path / "out" / "notes.parquet.job"


# `python -m llmbatch ARGS` with Ctrl-C's default meaning: a process started in the background
# (`cmd &`, nohup, some CI runners) inherits SIGINT ignored, and Python keeps it ignored, so the
# test's Ctrl-C would never reach the driver
DRIVER = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "sys.argv[0] = 'llmbatch'; runpy.run_module('llmbatch', run_name='__main__', alter_sys=True)")


def cli(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    fh = open(log, "ab")
    return subprocess.Popen([sys.executable, "-c", DRIVER, *args], stdout=fh, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def status(job_dir: Path) -> dict:
    """`llmbatch status` in the test process (tests/e2e/inproc.py): another process than the
    driver's, which is what it must see through."""
    out = llmbatch("status", str(job_dir), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def output_ids(job_dir: Path) -> tuple[list, list]:
    stats = json.loads((job_dir / "stats.json").read_text())
    ok = [int(i) for i in pq.read_table(stats["output"]).column("Index").to_pylist()]  # CSV cells are text
    errors = [int(json.loads(line)["id"]) for line in (job_dir / "errors.jsonl").read_text().splitlines()]
    return ok, errors


def tallies(tally: Path) -> dict[str, int]:
    """The requests each run's engine stage handed its engine (stages/engine.py's tally: a file
    per stage, a byte per request), by file."""
    return {f.name: f.stat().st_size for f in tally.glob("*")} if tally.is_dir() else {}


def journaled(job_dir: Path) -> int:
    """The distinct answers in the job's journal (a line each; the batch a killed driver's
    replica left in a warm engine host can still be answered and journaled while the next run
    starts, which then computes it again: two lines, one answer)."""
    journal = job_dir / "answers"
    lines = [line for f in journal.glob("*") for line in f.read_text().splitlines()] if journal.is_dir() else []
    return len({key for key in map(journal_key, lines) if key})


def journal_key(line: str) -> str:
    """The request digest of a journal line ("" for a line a kill cut short)."""
    try:
        return json.loads(line)["k"]
    except (ValueError, KeyError, TypeError):
        return ""


def test_sigkill_at_three_points_and_sigint_then_resume_exactly_once(ray_cluster, smollm2, tmp_path):
    rows, tail = 160, 20
    job_file, job_dir = write_job(tmp_path, rows, long_tail=tail)
    log = tmp_path / "driver.log"
    tally = tmp_path / "tally"  # every request the engine was handed, across the kills
    tallied = functools.partial(cli, env={"LLMBATCH_REQUEST_TALLY_DIR": str(tally)})

    # 1. SIGKILL before the first commit: the input is staged, Ray and the replica are starting
    # (killed the moment the input is staged: rows take seconds to come back even from a warm
    # engine, the first commit a second after them)
    p = tallied("run", str(job_file), "--quiet", log=log)
    wait_for(lambda: JobDir(job_dir).exists() and JobDir(job_dir).meta().ingested, 300, "staged", p)
    assert committed(job_dir) == 0
    kill9(p)
    assert committed(job_dir) == 0
    assert status(job_dir)["state"].startswith("interrupted")

    # 2. SIGKILL mid-way; `status` from another process sees the driver's counts while it runs
    p = tallied("resume", str(job_dir), "--quiet", log=log)
    wait_for(lambda: committed(job_dir) >= 30, BOUND_S, "some committed rows", p, step=POLL_S)
    live = status(job_dir)
    assert live["state"] == "running" and live["rows_total"] == rows
    assert 30 <= live["rows_done"] <= rows and live["rows_done"] == live["rows_ok"] + live["rows_error"]
    kill9(p)
    mid = committed(job_dir)
    assert 30 <= mid < rows - tail

    # 3. Ctrl-C stops cleanly within seconds and keeps what was answered
    p = tallied("resume", str(job_dir), "--quiet", log=log)
    wait_for(lambda: committed(job_dir) >= mid + 16, BOUND_S, "progress after resume", p, step=POLL_S)
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    assert p.wait(timeout=60) == 130
    assert time.monotonic() - t0 < 30
    after_int = committed(job_dir)
    assert mid < after_int < rows - tail
    assert status(job_dir)["state"].startswith("stopped")

    # 4. SIGKILL while the last part is being made (only the long last rows are left)
    p = tallied("resume", str(job_dir), "--quiet", log=log)
    near_end = rows - tail - 8  # every short row (the long ones take several times longer)
    wait_for(lambda: committed(job_dir) >= near_end, BOUND_S, "all but the last part", p, step=0.2)
    assert p.poll() is None, "the job finished before it could be killed in its last part"
    kill9(p)
    assert near_end <= committed(job_dir) < rows

    # 5. resume to the end: every input id exactly once across output and errors
    before, known = tallies(tally), journaled(job_dir)
    p = tallied("resume", str(job_dir), "--quiet", log=log)
    assert p.wait(timeout=BOUND_S) == 0, log.read_text()[-3000:]
    ok, errors = output_ids(job_dir)
    assert sorted(ok + errors) == list(range(1, rows + 1)), "lost or duplicated rows"
    assert errors == []
    # no answer the killed runs made is made again, committed or not (the answer journal): the
    # last run sends only the rows whose answers no run journaled (the killed runs' stages keep
    # their own tally files, so what the last killed one still sent is not counted as the last's)
    after = tallies(tally)
    last = sum(n for name, n in after.items() if name not in before)
    assert 0 < known <= sum(before.values()) and last <= rows - known, (last, known, before, after)
    assert not (job_dir / "answers").exists(), "a finished job keeps no journal: its answers are committed"
    done = status(job_dir)
    assert done["state"] == "finished" and done["rows_done"] == rows and done["rows_todo"] == 0
    runs = JobDir(job_dir).meta().runs
    assert [r["state"] for r in runs][-2:] == ["stopped", "finished"]


def job_replica(job_dir: Path) -> psutil.Process | None:
    """The replica the running job's driver names in its ``progress.json`` (``host:pid``: the
    Ray Data actor whose engine stage answered its rows, stages/engine.py), alive on this machine.
    With ``keep_warm_s: 0`` its engine runs below it and dies with it (its reaper). Found by the
    job's own record: a scan of the cluster's process table also finds earlier tests' actors
    that are still going away, and was slow enough that a short job ended first."""
    try:
        names = json.loads(JobDir(job_dir).progress_path.read_text()).get("replicas", {})
    except (OSError, ValueError):  # not written yet
        return None
    for name in names:
        host, _, pid = name.rpartition(":")
        if host != os.uname().nodename or not pid.isdigit():
            continue
        try:
            proc = psutil.Process(int(pid))
        except psutil.Error:
            continue
        if "StageRunner" in command_line(proc):
            return proc
    return None


def test_engine_replica_killed_mid_run_loses_no_row(ray_cluster, smollm2, tmp_path):
    rows = 48
    # the replica's own engine (no warm host): killing the replica kills its engine. Half the
    # rows write longer answers and the last 8 the longest (400 tokens: many seconds on this
    # CPU), so the job is still running when the first 16 are committed, even on a busy machine
    # (with 150 the job ended before the replica was found, twice in fresh clones)
    job_file, job_dir = write_job(tmp_path, rows, long_tail=24, keep_warm_s=0, last_tokens=400)
    log = tmp_path / "driver.log"
    p = cli("run", str(job_file), "--quiet", log=log)
    wait_for(lambda: committed(job_dir) >= 16, BOUND_S, "first parts", p, step=POLL_S)
    replica: list = []

    def found() -> bool:
        replica[:] = [job_replica(job_dir)]
        return replica[0] is not None

    wait_for(found, 60, "the replica named in progress.json", p, step=0.2)
    assert committed(job_dir) < rows, "the job should still be running when its replica is killed"
    replica[0].send_signal(signal.SIGKILL)
    assert p.wait(timeout=BOUND_S) == 0, log.read_text()[-3000:]
    ok, errors = output_ids(job_dir)
    assert sorted(ok + errors) == list(range(1, rows + 1))
    assert errors == []
    stats = json.loads((job_dir / "stats.json").read_text())
    assert len(stats["rows_by_replica"]) >= 2, "rows should come from the replica before and after the kill"
