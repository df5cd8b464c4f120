"""Reading job inputs as a stream of row batches, in bounded memory.

Formats: ``csv``, ``jsonl``, ``json`` (one array of objects), ``parquet``, ``hf`` (a
Hugging Face dataset saved with ``save_to_disk``, read without the ``datasets`` package) and
``images`` (a folder of image files: one row per file, ``path`` and ``name``).
Paths may be local, ``http(s)://`` or ``s3://`` / ``gs://`` (fsspec; s3fs / gcsfs).

A malformed record never stops the read: it becomes a row whose :data:`READ_ERROR` column
says what is wrong (invalid JSON line, bytes that are not UTF-8), so the job can report it as
an error row with the rest of the input answered.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from llmbatch.errors import ConfigError, MissingDependencyError
from llmbatch.io.json_records import json_records, jsonl_records
from llmbatch.io.media import is_image_folder, read_image_folder

#: Column carrying a row's read error ("" when the row was read fine).
READ_ERROR = "__llmbatch_read_error"
FORMATS = ("csv", "jsonl", "json", "parquet", "hf", "images")
DEFAULT_BATCH_ROWS = 8192
#: A cell larger than this is kept but the row is flagged (it is almost always a broken file).
MAX_CELL_BYTES = 64 * 1024 * 1024


def infer_format(path: str) -> str:
    """The input format from the path (``.csv``, ``.jsonl``, ``.parquet``...)."""
    lower = path.lower().split("?", 1)[0]
    for suffix in (".gz", ".bz2", ".zst", ".xz"):
        lower = lower.removesuffix(suffix)
    if lower.endswith(".csv") or lower.endswith(".tsv"):
        return "csv"
    if lower.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if lower.endswith(".json"):
        return "json"
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    if os.path.isdir(lower) and os.path.exists(os.path.join(lower, "state.json")):
        return "hf"
    if os.path.isdir(lower) and any(n.endswith(".parquet") for n in os.listdir(lower)):
        return "parquet"
    if is_image_folder(lower):
        return "images"
    raise ConfigError(f"cannot tell the format of {path!r}; set input.format to one of {', '.join(FORMATS)}")


def open_input(path: str, mode: str = "rb"):
    """Open a local path or URL (fsspec for remote paths; compression from the suffix)."""
    if "://" not in path or path.startswith("file://"):
        local = path.removeprefix("file://")
        if not os.path.exists(local):
            raise ConfigError(f"input {path!r} does not exist")
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - fsspec is a dependency
        raise MissingDependencyError("reading inputs", "fsspec") from exc
    try:
        return fsspec.open(path, mode, compression="infer").open()
    except ImportError as exc:
        pkg = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp"}.get(
            path.split("://", 1)[0], "fsspec")
        raise MissingDependencyError(f"reading {path}", pkg) from exc
    except FileNotFoundError as exc:
        raise ConfigError(f"input {path!r} does not exist") from exc


def _select(rows: list[dict[str, Any]], columns: list[str] | None, known: list[str]) -> list[dict[str, Any]]:
    if not columns:
        return rows
    missing = [c for c in columns if c not in known]
    if missing:
        raise ConfigError(f"input.columns names {missing}, which the input does not have; it has {known}")
    keep = columns + [READ_ERROR]
    return [{k: row.get(k) for k in keep} for row in rows]


def _from_batch(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    rows = batch.to_pylist()
    for row in rows:
        row[READ_ERROR] = ""
    return rows


# ---------------------------------------------------------------------------- CSV


def _check_text(cell: str) -> tuple[str, str]:
    """A CSV cell decoded with surrogateescape: (clean text, read error or "")."""
    if not cell.isascii():
        try:
            cell.encode("utf-8")
        except UnicodeEncodeError:
            raw = cell.encode("utf-8", "surrogateescape")
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return raw.decode("utf-8", "replace"), (
                    f"read: UnicodeDecodeError: a cell is not UTF-8 ({exc.reason} at byte {exc.start}); "
                    f"save the file as UTF-8")
    if len(cell) > MAX_CELL_BYTES:
        return cell, f"read: CellTooLargeError: a cell has {len(cell):,} characters (limit {MAX_CELL_BYTES:,})"
    return cell, ""


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.IGNORECASE)
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_BOOLS = {"true", "false"}
#: Arrow types a CSV column may be given in the output, in the order they are tried.
TEXT_TYPES = ("int64", "float64", "bool", "date32", "string")


class TextTypes:
    """The type of each CSV column, inferred from all its cells as Arrow's CSV reader infers
    it (int64, float64, bool, date32, else string; empty cells are nulls).

    Prompts always show a cell's text as written; the type is what the output file keeps.
    """

    def __init__(self):
        self._possible: dict[str, set[str]] = {}

    def add(self, row: dict[str, Any]) -> None:
        for name, value in row.items():
            possible = self._possible.setdefault(name, set(TEXT_TYPES[:-1]))
            if not possible or value is None or value == "":
                continue
            text = str(value).strip()
            if "int64" in possible and not (_INT.fullmatch(text) and -(1 << 63) <= int(text) < (1 << 63)):
                possible.discard("int64")
            if "float64" in possible and not _FLOAT.fullmatch(text):
                possible.discard("float64")
            if "bool" in possible and text.lower() not in _BOOLS:
                possible.discard("bool")
            if "date32" in possible and not _DATE.fullmatch(text):
                possible.discard("date32")

    def result(self, columns: list[str]) -> dict[str, str]:
        """Column -> the first type of :data:`TEXT_TYPES` that holds every cell."""
        out = {}
        for name in columns:
            possible = self._possible.get(name, set())
            out[name] = next((t for t in TEXT_TYPES if t in possible), "string")
        return out


def typed_text_column(array: pa.Array, type_name: str) -> pa.Array:
    """A column of CSV cell texts as ``type_name`` (see :class:`TextTypes`); empty cells are
    nulls. Raises ``pa.ArrowInvalid`` when a cell does not fit."""
    import pyarrow.compute as pc

    if type_name == "string":
        return array
    text = pc.utf8_trim_whitespace(array.cast(pa.string()))
    text = pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.string()), text)
    if type_name == "bool":
        return pc.equal(pc.utf8_lower(text), "true")
    return pc.cast(text, pa.type_for_alias(type_name))


Record = tuple[dict[str, Any], str]  # a row and its read error ("" when it was read fine)


def batched(records: Iterator[Record], batch_rows: int) -> Iterator[list[dict[str, Any]]]:
    """Rows in lists of ``batch_rows``, each with its :data:`READ_ERROR`."""
    rows: list[dict[str, Any]] = []
    for row, err in records:
        row[READ_ERROR] = err
        rows.append(row)
        if len(rows) >= batch_rows:
            yield rows
            rows = []
    if rows:
        yield rows


@contextlib.contextmanager
def _csv_field_limit(limit: int) -> Iterator[None]:
    """Raise the csv module's field size limit while one file is read, then put it back."""
    old = csv.field_size_limit(limit)
    try:
        yield
    finally:
        csv.field_size_limit(old)


def _csv_records(fh) -> Iterator[Record]:
    text = io.TextIOWrapper(fh, encoding="utf-8", errors="surrogateescape", newline="")
    reader = csv.reader(text)
    header = next(reader, None)
    if header is None:
        return
    header = [_check_text(h)[0] for h in header]
    while True:
        line = reader.line_num + 1
        try:
            record = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:  # the record's error; the reader goes on with the next line
            yield dict.fromkeys(header), f"read: CSVRecordError: the record on line {line} cannot be read ({exc})"
            continue
        row: dict[str, Any] = {}
        err = ""
        if len(record) != len(header):
            err = f"read: CSVRecordError: the record on line {line} has {len(record)} fields, the header has {len(header)}"
        for name, cell in zip(header, record):
            value, cell_err = _check_text(cell)
            row[name] = value
            err = err or (cell_err and cell_err.replace("a cell", f"a cell on line {line}", 1))
        for name in header[len(record):]:
            row[name] = None
        yield row, err


def read_csv(path: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[list[dict[str, Any]]]:
    """CSV, one record at a time, every cell as text (CSV has no types).

    A record with bytes that are not UTF-8 or the wrong number of fields is kept and flagged
    in :data:`READ_ERROR`; the read goes on.
    """
    with open_input(path) as fh, _csv_field_limit(MAX_CELL_BYTES * 4):
        yield from batched(_csv_records(fh), batch_rows)


# ---------------------------------------------------------------------------- JSON


def read_jsonl(path: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[list[dict[str, Any]]]:
    """JSON Lines; a line that is not a JSON object becomes a flagged row."""
    with open_input(path) as fh:
        yield from batched(jsonl_records(fh), batch_rows)


def read_json(path: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[list[dict[str, Any]]]:
    """A JSON array of objects (or {"data": [...]}). Streams with ijson when it is installed."""
    with open_input(path) as fh:
        yield from batched(json_records(fh), batch_rows)


# ---------------------------------------------------------------------------- Parquet, HF


def read_parquet(path: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[list[dict[str, Any]]]:
    import pyarrow.dataset as pads

    if "://" in path and not path.startswith("file://"):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        dataset = pads.dataset(p, format="parquet", filesystem=fs)
    else:
        dataset = pads.dataset(path.removeprefix("file://"), format="parquet")
    for batch in dataset.to_batches(batch_size=batch_rows):
        yield _from_batch(batch)


def read_hf(path: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[list[dict[str, Any]]]:
    """A dataset saved with ``datasets.Dataset.save_to_disk`` (Arrow IPC stream files)."""
    import pyarrow.ipc as ipc

    state_path = os.path.join(path, "state.json")
    if not os.path.exists(state_path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")):
            raise ConfigError(f"{path} is a DatasetDict; point input.path at one split, e.g. {path}/train")
        raise ConfigError(f"{path} is not a dataset saved with save_to_disk (no state.json)")
    with open(state_path) as fh:
        files = [f["filename"] for f in json.load(fh)["_data_files"]]
    root = os.path.realpath(path)
    for name in files:
        target = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([root, target]) != root:
            raise ConfigError(f"{state_path} names the data file {name!r}, which is outside the dataset folder; "
                              "refusing to read it (a damaged or hostile state.json)")
        with open(target, "rb") as fh:
            reader = ipc.open_stream(fh)
            for batch in reader:
                for start in range(0, batch.num_rows, batch_rows):
                    yield _from_batch(batch.slice(start, batch_rows))


def read_images(path: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[list[dict[str, Any]]]:
    return ([{**r, READ_ERROR: ""} for r in rows] for rows in read_image_folder(path, batch_rows))


READERS = {"csv": read_csv, "jsonl": read_jsonl, "json": read_json, "parquet": read_parquet, "hf": read_hf,
           "images": read_images}


def read_rows(path: str, fmt: str | None = None, columns: list[str] | None = None,
              limit: int | None = None, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[list[dict[str, Any]]]:
    """Stream ``path`` as lists of dict rows (each with :data:`READ_ERROR`), honouring
    ``columns`` and ``limit``."""
    fmt = fmt or infer_format(path)
    if fmt not in READERS:
        raise ConfigError(f"unknown input format {fmt!r}; use one of {', '.join(FORMATS)}")
    seen = 0
    known: list[str] = []
    for rows in READERS[fmt](path, batch_rows=batch_rows):
        if limit is not None:
            rows = rows[: max(0, limit - seen)]
        if not rows:
            if limit is not None and seen >= limit:
                return
            continue
        seen += len(rows)
        if columns and not known:
            known = list(dict.fromkeys(k for r in rows for k in r if k != READ_ERROR))
        yield _select(rows, columns, known)
        if limit is not None and seen >= limit:
            return
