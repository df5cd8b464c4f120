"""A job directory's own files cannot be turned against the job: ``log.txt`` and ``lock`` are
not followed when they are symlinks; a part is published without replacing one that is there
(a second driver the lock failed to exclude cannot overwrite committed answers); a crash's
``.tmp`` litter is removed on the next run; a ``status`` probe of the lock never fails a
driver that is starting."""

from __future__ import annotations

import fcntl
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmbatch.errors import JobError
from llmbatch.jobs import lock as lock_module
from llmbatch.jobs.store import LOCK_NAME, JobDir


def test_log_and_lock_are_not_followed_when_they_are_symlinks(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    job = JobDir(tmp_path / "job")
    job.root.mkdir()
    job.log_path.symlink_to(outside)
    with pytest.raises(JobError, match="symbolic link"):
        job.log("a line")
    (job.root / LOCK_NAME).symlink_to(outside)
    with pytest.raises(JobError, match="symbolic link"):
        with job.locked():
            pass
    assert outside.read_text() == "precious\n"


def test_a_committed_part_is_never_replaced(tmp_path):
    first = JobDir(tmp_path / "job")
    path = first.commit(pa.table({"x": [1]}))
    second = JobDir(tmp_path / "job")
    second._next_part = 0  # a second driver that scanned the parts before the first committed
    with pytest.raises(JobError, match="committed by another driver"):
        second.commit(pa.table({"x": [2]}))
    assert pq.read_table(path).column("x").to_pylist() == [1]
    assert [p.name for p in first.parts_dir.iterdir()] == [path.name]  # no litter either


def test_a_crashs_temporaries_are_removed(tmp_path):
    job = JobDir(tmp_path / "job")
    job.parts_dir.mkdir(parents=True)
    litter = [job.root / ".job.json.tmp", job.root / ".stats.json.tmp", job.root / ".errors.jsonl.tmp",
              job.parts_dir / ".part-000003.parquet.tmp"]
    for path in litter:
        path.write_text("half")
    (job.root / ".input.tmp").mkdir()
    (job.root / ".input.tmp" / "part-000000.parquet").write_text("half")
    (job.root / "job.json").write_text("{}")
    job.clean_temporaries()
    assert sorted(p.name for p in job.root.iterdir()) == ["job.json", "parts"]
    assert list(job.parts_dir.iterdir()) == []


def test_a_status_probe_never_fails_a_driver_that_is_starting(tmp_path, monkeypatch):
    job = JobDir(tmp_path / "job")
    job.root.mkdir()
    (job.root / LOCK_NAME).write_text("")
    probe = open(job.root / LOCK_NAME)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # `llmbatch status` asking, at that instant
    waited = []

    def probe_ends(seconds):
        waited.append(seconds)
        fcntl.flock(probe, fcntl.LOCK_UN)

    monkeypatch.setattr(lock_module, "time", types.SimpleNamespace(monotonic=lock_module.time.monotonic,
                                                                    sleep=probe_ends))
    with job.locked():
        assert waited and job.is_running()
    probe.close()
    assert not job.is_running()


def test_a_running_driver_is_still_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "LOCK_WAIT_S", 0.0)
    job = JobDir(tmp_path / "job")
    with job.locked():
        with pytest.raises(JobError, match="running in another process"):
            with JobDir(job.root).locked():
                pass
