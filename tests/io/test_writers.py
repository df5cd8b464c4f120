"""Outputs: one schema across parts that disagree, three formats, nothing half written."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmbatch.io.writers import OutputWriter, conform, unify_schema


def test_unify_widens_where_arrow_can_and_falls_back_to_text():
    a = pa.schema([("x", pa.int64()), ("y", pa.null()), ("z", pa.int64())])
    b = pa.schema([("x", pa.float64()), ("y", pa.string()), ("z", pa.list_(pa.int64()))])
    schema = unify_schema([a, b], ["x", "y", "z", "w"])
    assert schema.field("x").type == pa.float64() and schema.field("y").type == pa.string()
    assert schema.field("z").type == pa.string() and schema.field("w").type == pa.string()
    table = conform(pa.table({"x": [1], "z": [[1, 2]]}), schema)
    assert table.to_pylist() == [{"x": 1.0, "y": None, "z": "[1, 2]", "w": None}]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_each_format_is_moved_into_place_only_when_committed(tmp_path, fmt):
    path = tmp_path / f"out.{fmt}"
    schema = pa.schema([("id", pa.int64()), ("answer", pa.string()), ("tokens", pa.list_(pa.int64()))])
    writer = OutputWriter(str(path), fmt, schema)
    writer.write(pa.table({"id": [1, 2], "answer": ["a", "b"], "tokens": [[1], [2, 3]]}))
    writer.finish()
    assert not path.exists()  # written beside its name until the commit
    assert writer.commit() == str(path) and path.exists()
    if fmt == "parquet":
        assert pq.read_table(path).column("tokens").to_pylist() == [[1], [2, 3]]
    elif fmt == "jsonl":
        assert [json.loads(line)["answer"] for line in path.read_text().splitlines()] == ["a", "b"]
    else:
        assert path.read_text().splitlines()[0] == '"id","answer","tokens"'


def test_abort_leaves_nothing(tmp_path):
    writer = OutputWriter(str(tmp_path / "out.parquet"), "parquet", pa.schema([("id", pa.int64())]))
    writer.write(pa.table({"id": [1]}))
    writer.abort()
    assert list(tmp_path.iterdir()) == []
