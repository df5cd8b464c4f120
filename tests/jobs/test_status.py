"""``status`` tells a job's state from its directory alone: never "finished" when it is not."""

from __future__ import annotations

import json

import pyarrow as pa

from llmbatch.jobs.meta import JobMeta
from llmbatch.jobs.status import job_status
from llmbatch.jobs.store import JobDir
from llmbatch.rows import ERROR_COLUMN, ROW_ID


def make(tmp_path, **meta):
    job = JobDir(tmp_path / "job")
    job.write_meta(JobMeta(spec={}, result_fields={}, numerics_fields={}, config_hash="", **meta))
    return job


def test_states_from_not_started_to_finished(tmp_path):
    job = make(tmp_path, rows=3)
    assert job_status(job.root)["state"] == "not started"
    meta = job.meta()
    meta.ingested = True
    job.write_meta(meta)
    # killed after staging, before its first progress file (only the temporary one is left)
    (job.root / ".progress.json.tmp").write_text("{}")
    assert job_status(job.root)["state"].startswith("interrupted")
    job.commit(pa.table({ROW_ID: [0], ERROR_COLUMN: [""]}))
    assert job_status(job.root)["state"].startswith("interrupted")
    with job.locked():
        assert job_status(job.root)["state"] == "running"
    job.progress_path.write_text(json.dumps({"state": "stopped"}))
    assert job_status(job.root)["state"].startswith("stopped")
    job.commit(pa.table({ROW_ID: [1, 2], ERROR_COLUMN: ["", "tokenize: PromptTooLongError: long"]}))
    info = job_status(job.root)
    assert info["state"].startswith("answered, output not written")
    assert info["rows_ok"] == 2 and info["rows_error"] == 1 and info["errors_by_type"] == {"tokenize: PromptTooLongError": 1}
    meta = job.meta()
    meta.finished = {"parts_upto": 1}
    job.write_meta(meta)
    assert job_status(job.root)["state"] == "finished"
    job.commit(pa.table({ROW_ID: [2], ERROR_COLUMN: [""]}))  # retry-errors committed more: output is stale
    info = job_status(job.root)
    assert info["state"] != "finished" and info["rows_error"] == 0


def test_a_running_job_shows_its_start_up_phase(tmp_path):
    """`status` of a job still starting says what it is doing (the driver's progress.json),
    in its JSON and in its table."""
    import time

    from typer.testing import CliRunner

    from llmbatch.cli import app
    from llmbatch.progress import Progress

    job = make(tmp_path, rows=8, ingested=True)
    progress = Progress(8, progress_path=job.progress_path, tty=False, quiet=True)
    progress.set_phase("loading the model")
    progress.phase_since = time.time() - 12  # for 12 s already
    progress.tick()
    with job.locked():
        info = job_status(job.root)
        table = CliRunner().invoke(app, ["status", str(job.root)], env={"COLUMNS": "100"}).stdout
    assert info["state"] == "running" and info["phase"] == "loading the model" and info["phase_s"] >= 12
    assert "loading the model (12s)" in table, table
