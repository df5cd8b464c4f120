"""The job directory's commit protocol and final output, without an engine."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmbatch.io.readers import read_rows
from llmbatch.jobs.ingest import ingest, input_rows
from llmbatch.jobs.meta import JobMeta
from llmbatch.jobs.store import JobDir
from llmbatch.rows import ERROR_COLUMN, ROW_ID


def test_staging_gives_stable_ids_and_keeps_bad_records(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_bytes(b'{"q": "a"}\nnot json\n{"q": "\xff"}\n{"q": "d"}\n')
    job = JobDir(tmp_path / "job")
    info = ingest(job, str(data), None, None, None, None)
    assert info["rows"] == 4
    rows = [r for f in job.input_files() for r in input_rows(f)]
    assert [r[ROW_ID] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["q"] == "a" and rows[3]["q"] == "d"
    assert rows[1][ERROR_COLUMN].startswith("read: JSONDecodeError: line 2")
    assert rows[2][ERROR_COLUMN].startswith("read: UnicodeDecodeError: line 3")
    again = JobDir(tmp_path / "job2")
    ingest(again, str(data), None, None, None, None)
    assert rows == [r for f in again.input_files() for r in input_rows(f)]


def test_staged_input_is_arrow_columns_not_pickles(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text('{"q": "a", "n": 1, "tags": ["x"]}\n{"q": 5, "n": 2, "tags": {"k": 1}}\n')
    job = JobDir(tmp_path / "job")
    ingest(job, str(data), None, None, None, None)
    (path,) = job.input_files()
    table = pq.read_table(path)
    assert not any(pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) for f in table.schema)
    assert table.schema.field("n").type == pa.int64()
    # columns whose values have no one type are JSON text, and come back as they were
    assert [r["q"] for r in input_rows(path)] == ["a", 5]
    assert [r["tags"] for r in input_rows(path)] == [["x"], {"k": 1}]
    assert b"\x80\x05" not in path.read_bytes()  # no pickle stream anywhere in the file


def test_commits_are_atomic_and_newest_part_wins(tmp_path):
    job = JobDir(tmp_path / "job")
    job.write_meta(JobMeta(spec={}, result_fields={}, numerics_fields={}, config_hash="", rows=4))
    job.commit(pa.table({ROW_ID: [0, 1, 2], ERROR_COLUMN: ["", "engine: X: y", ""]}))
    job.commit(pa.table({ROW_ID: [1, 3], ERROR_COLUMN: ["", ""]}))
    (job.parts_dir / ".part-000002.parquet.tmp").write_bytes(b"half a file")
    state = job.state()
    assert state.counts() == {"rows": 4, "done": 4, "ok": 4, "errors": 0, "todo": 0}
    assert state.latest.tolist() == [0, 1, 0, 1]
    job.clean_temporaries()
    assert not list(job.parts_dir.glob(".*.tmp"))


def test_csv_reader_never_stops_on_a_bad_record(tmp_path):
    path = tmp_path / "x.csv"
    path.write_bytes(b"a,b\n1,ok\n2,h\xe9\n3\n4,\"multi\nline\"\n")
    rows = [r for batch in read_rows(str(path)) for r in batch]
    assert [r["a"] for r in rows] == ["1", "2", "3", "4"]
    errors = [r["__llmbatch_read_error"] for r in rows]
    assert errors[0] == "" and errors[3] == "" and rows[3]["b"] == "multi\nline"
    assert errors[1].startswith("read: UnicodeDecodeError") and errors[2].startswith("read: CSVRecordError")


def test_lock_refuses_a_second_driver(tmp_path):
    from llmbatch.errors import JobError

    job = JobDir(tmp_path / "job")
    with job.locked():
        assert job.is_running()
        with pytest.raises(JobError, match="running in another process"):
            with JobDir(tmp_path / "job").locked():
                pass
    assert not job.is_running()


def test_parts_are_read_ahead_in_order_and_a_failed_read_raises():
    import threading

    from llmbatch.jobs import store

    paths = [Path(f"part-{i:06d}.parquet") for i in range(40)]
    running, most = 0, 0
    lock = threading.Lock()

    def read(path):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            if path.name == "part-000031.parquet":
                raise OSError("disk gone")
            return path.name
        finally:
            with lock:
                running -= 1

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for path, value in store.read_ahead(paths, read):
            assert value == path.name
            seen.append(value)
    assert seen == [p.name for p in paths[:31]], "in order, up to the part that failed"
    assert most <= store.READ_AHEAD
