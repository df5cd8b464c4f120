"""Input formats and locations, read for real (files on disk, an HTTP server on loopback)."""

from __future__ import annotations

import functools
import http.server
import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmbatch.errors import ConfigError
from llmbatch.io.readers import READ_ERROR, infer_format, read_rows
from llmbatch.jobs.store import input_fingerprint


def rows_of(path, **kw):
    return [r for batch in read_rows(str(path), **kw) for r in batch]


@pytest.fixture
def http_dir(tmp_path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_csv_over_http(http_dir):
    folder, url = http_dir
    (folder / "c.csv").write_text("Index,Company\n1,Acme\n2,Globex\n")
    rows = rows_of(f"{url}/c.csv")
    assert [(r["Index"], r["Company"], r[READ_ERROR]) for r in rows] == [("1", "Acme", ""), ("2", "Globex", "")]
    assert input_fingerprint(f"{url}/c.csv")["files"][0]["sha256"] == input_fingerprint(str(folder / "c.csv"))["files"][0]["sha256"]


def test_jsonl_json_parquet(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"x": 1, "tags": ["a"]}\n\n{"x": 2, "tags": []}\n')
    (tmp_path / "a.json").write_text(json.dumps([{"x": 1}, {"x": 2}, 5]))
    pq.write_table(pa.table({"x": [1, 2, 3], "y": ["a", "b", "c"]}), tmp_path / "a.parquet")
    assert [r["x"] for r in rows_of(tmp_path / "a.jsonl")] == [1, 2]
    js = rows_of(tmp_path / "a.json")
    assert [r.get("x") for r in js] == [1, 2, None] and js[2][READ_ERROR].startswith("read: JSONRecordError")
    assert [r["y"] for r in rows_of(tmp_path / "a.parquet", limit=2)] == ["a", "b"]
    assert [list(r) for r in rows_of(tmp_path / "a.parquet", columns=["y"])][0] == ["y", READ_ERROR]
    with pytest.raises(ConfigError, match="does not have"):
        rows_of(tmp_path / "a.parquet", columns=["nope"])


def test_hugging_face_dataset_saved_to_disk(tmp_path):
    # the layout datasets.Dataset.save_to_disk writes: Arrow IPC stream files + state.json
    folder = tmp_path / "ds"
    folder.mkdir()
    table = pa.table({"text": ["a", "b", "c"], "label": [0, 1, 0]})
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                   "_fingerprint": "x", "_split": "train"}))
    (folder / "dataset_info.json").write_text("{}")
    assert infer_format(str(folder)) == "hf"
    assert [(r["text"], r["label"]) for r in rows_of(folder)] == [("a", 0), ("b", 1), ("c", 0)]


def test_unknown_format_and_missing_file(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ConfigError, match="input.format"):
        rows_of(tmp_path / "x.txt")
    with pytest.raises(ConfigError, match="does not exist"):
        rows_of(tmp_path / "missing.csv")


def test_hf_dataset_state_cannot_name_files_outside_its_folder(tmp_path):
    import json

    from llmbatch.errors import ConfigError

    secret = tmp_path / "secret.arrow"
    secret.write_bytes(b"not yours")
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../secret.arrow"}]}))
    with pytest.raises(ConfigError, match="outside the dataset folder"):
        list(read_rows(str(ds), "hf"))
