"""A clean CSV read by pyarrow's reader (io/csv_tables.py) gives the job exactly the input files,
ids and column types the record reader gives; a file it would read otherwise goes to the record
reader, which makes its error rows as before."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmbatch.io.csv_tables import NotClean, csv_tables
from llmbatch.io.readers import read_rows
from llmbatch.jobs import ingest as ingest_module
from llmbatch.jobs.ingest import ingest
from llmbatch.jobs.store import JobDir

CLEAN = {
    "types": "Index,Count,Price,Flag,Day,Name,Blank\n"
             "1,+7,1.5,TRUE,2024-01-02,Acme,\n2,-3,1e5,false,2023-12-31,Birch,\n3,0012,inf,True,2020-02-29,  ,\n",
    "quoted": 'a,b\n"x, with comma","line one\nline two"\n"say ""hi""",plain\r\nc,d\r\n',
    "non-ascii": "a,b\n1,Zürich\n\u0663,Ω\n2, spaced \n",   # an Arabic-Indic digit: Python's int() takes it
    "big ints": "a,b\n9223372036854775807,1\n9223372036854775808,2\n",
    "nan and empty": "a,b\nnan,\n,x\n-inf,y\n",
}

NOT_CLEAN = {
    "short record": "a,b\n1,2\n3\n4,5\n",
    "blank line": "a,b\n1,2\n\n3,4\n",
    "byte-order mark": "\ufeffa,b\n1,2\n",
    "repeated names": "a,a\n1,2\n",
    "one column": "a\n1\n\n2\n",
}


def read_both(tmp_path, name: str, content: str | bytes, monkeypatch, **kw):
    """The job's input files, ids and types from the record reader and from csv_tables."""
    monkeypatch.setattr(ingest_module, "INGEST_ROWS", 2)  # several input files
    path = tmp_path / f"{name.replace(' ', '_')}.csv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = []
    for fast in (False, True):
        job = JobDir(tmp_path / f"job-{path.stem}-{fast}")
        job.root.mkdir()
        columns, limit, id_column = kw.get("columns"), kw.get("limit"), kw.get("id_column")
        info = ingest(job, str(path), "csv", columns, limit, id_column, read_rows(str(path), "csv", columns, limit),
                      csv_tables(str(path), columns, limit) if fast else None)
        files = [pq.read_table(f) for f in job.input_files()]
        log = job.root.joinpath("log.txt").read_text() if job.root.joinpath("log.txt").exists() else ""
        out.append((info, files, log))
    return out


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_a_clean_file_gives_the_same_input_files_ids_and_types(tmp_path, monkeypatch, name):
    (records, record_files, _), (tables, table_files, log) = read_both(tmp_path, name, CLEAN[name], monkeypatch)
    assert "record by record" not in log, log
    assert tables == records
    assert [len(f) for f in table_files] == [len(f) for f in record_files]
    for a, b in zip(table_files, record_files):
        assert a.to_pylist() == b.to_pylist()
        assert a.schema.equals(b.schema, check_metadata=False), (a.schema, b.schema)


def test_the_types_are_those_the_record_reader_infers(tmp_path, monkeypatch):
    (records, _, _), (tables, _, _) = read_both(tmp_path, "types", CLEAN["types"], monkeypatch)
    assert tables["column_types"] == {"Index": "int64", "Count": "int64", "Price": "float64", "Flag": "bool",
                                      "Day": "date32", "Name": "string", "Blank": "int64"}
    assert records["column_types"] == tables["column_types"]


def test_columns_limit_and_id_column_as_the_record_reader(tmp_path, monkeypatch):
    content = "id,q,x\n" + "".join(f"k{i},question {i % 3},{i}\n" for i in range(7))
    (records, record_files, _), (tables, table_files, log) = read_both(
        tmp_path, "select", content, monkeypatch, columns=["q", "id"], limit=5, id_column="id")
    assert "record by record" not in log
    assert tables == records and tables["rows"] == 5 and tables["columns"] == ["q", "id"]
    assert [f.to_pylist() for f in table_files] == [f.to_pylist() for f in record_files]


@pytest.mark.parametrize("name", sorted(NOT_CLEAN))
def test_a_file_the_record_reader_must_read_goes_to_it(tmp_path, monkeypatch, name):
    (records, record_files, _), (tables, table_files, log) = read_both(tmp_path, name, NOT_CLEAN[name], monkeypatch)
    assert "input read record by record" in log, log
    assert tables == records
    assert [f.to_pylist() for f in table_files] == [f.to_pylist() for f in record_files]


def test_bytes_that_are_not_utf8_and_repeated_or_empty_ids_go_to_the_record_reader(tmp_path, monkeypatch):
    bad = b"a,b\n1,caf\xe9\n2,ok\n"
    (records, record_files, _), (tables, table_files, log) = read_both(tmp_path, "latin1", bad, monkeypatch)
    assert "record by record" in log and tables == records
    assert "UnicodeDecodeError" in str([f.to_pylist() for f in table_files])
    (_, _, log), = read_both(tmp_path, "empty id", "id,b\nx,1\n,2\n", monkeypatch, id_column="id")[1:]
    assert "record by record" in log
    from llmbatch.errors import JobError

    with pytest.raises(JobError, match="duplicate values"):
        read_both(tmp_path, "dup id", "id,b\nx,1\nx,2\n", monkeypatch, id_column="id")


def test_csv_tables_says_why_it_gives_up(tmp_path):
    path = tmp_path / "short.csv"
    path.write_text(NOT_CLEAN["short record"])
    with pytest.raises(NotClean, match="could not read"):
        list(csv_tables(str(path)))
    path.write_text("a,b\n" + "1,2\n" * 3)
    assert pa.concat_tables(list(csv_tables(str(path)))).num_rows == 3
