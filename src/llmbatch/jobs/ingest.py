"""Reading a job's input once into its directory, with a stable id per row.

``input/part-*.parquet`` holds the rows as Arrow columns (JSON text for a column whose values
have no one type; never a pickle), each row with its id (its ``id_column`` value's order, or
its position) and, for a record that could not be read, its read error. Every later run reads
the rows from here, so the ids never change; each file is fsynced before ``job.json`` says the
input is there. A run sends the rows still to do from these files (:func:`todo_dataset`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from llmbatch.codec import digest64, encode_rows, rows_to_table, table_to_rows
from llmbatch.errors import JobError
from llmbatch.io.csv_tables import ColumnTypes, NotClean
from llmbatch.io.files import fsync_dir, write_parquet_synced
from llmbatch.io.readers import READ_ERROR, TextTypes, infer_format, read_rows
from llmbatch.jobs.store import JobDir
from llmbatch.rows import ERROR_COLUMN, ROW_ID, is_missing

if TYPE_CHECKING:
    from llmbatch.jobs.job import Job

#: Rows per file of ``input/``.
INGEST_ROWS = 20_000
KEY_COLUMN = "__llmbatch_key"


def input_rows(path: Path, ids: np.ndarray | None = None, mask: np.ndarray | None = None) -> list[dict[str, Any]]:
    """The rows of one input file (only ``ids``, or the ids ``mask`` marks, when given), as the
    processor gets them."""
    table = pq.read_table(path)
    if ids is not None:
        table = table.filter(pa.array(np.isin(table.column(ROW_ID).to_numpy(), ids)))
    if mask is not None:
        table = table.filter(pa.array(mask[table.column(ROW_ID).to_numpy()]))
    rows = table_to_rows(table.drop_columns([KEY_COLUMN]))
    for row in rows:
        if not row.get(ERROR_COLUMN):
            row.pop(ERROR_COLUMN, None)
    return rows


def _key_text(row: dict[str, Any], id_column: str | None) -> str | None:
    if id_column is None:
        return str(row[ROW_ID])
    value = row.get(id_column)
    return None if is_missing(value) else str(value)


class _Writer:
    """Buffers rows and writes them as numbered, fsynced files into a folder."""

    def __init__(self, folder: Path, id_column: str | None):
        self.folder = folder
        self.id_column = id_column
        self.buffer: list[dict[str, Any]] = []
        self.part = 0

    def add(self, row: dict[str, Any]) -> None:
        self.buffer.append(row)
        if len(self.buffer) >= INGEST_ROWS:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        table = rows_to_table(self.buffer)
        keys = pa.array([_key_text(r, self.id_column) for r in self.buffer], pa.string())
        write_parquet_synced(table.append_column(KEY_COLUMN, keys), self.folder / f"part-{self.part:05d}.parquet")
        self.part += 1
        self.buffer = []


def ingest(job: JobDir, path: str, fmt: str | None, columns: list[str] | None, limit: int | None,
           id_column: str | None, batches: Iterator[list[dict[str, Any]]] | None = None,
           tables: Iterator[pa.Table] | None = None) -> dict[str, Any]:
    """Read the input once into ``input/`` with stable row ids; returns what it learned
    (rows, columns, CSV column types). ``batches``: the records as the job's kind reads them
    (default: ``path`` read as a table); ``tables``: the same rows as Arrow tables of CSV text,
    tried first (``io.csv_tables``: a file it cannot read as the records are read is read
    from ``batches`` instead).

    Raises :class:`JobError` when ``id_column`` is missing or has duplicate values.
    """
    if tables is not None:
        try:
            return _ingest_tables(job, tables, id_column)
        except NotClean as exc:
            job.log(f"input read record by record: {exc}")
    tmp_dir = _fresh_dirs(job)
    writer = _Writer(tmp_dir, id_column)
    types = TextTypes() if (fmt or infer_format(path)) == "csv" else None
    next_id = 0
    keys: list[int] = []
    seen_columns: dict[str, None] = {}
    if batches is None:
        batches = read_rows(path, fmt, columns, limit)
    for rows in batches:
        for row in rows:
            read_error = row.pop(READ_ERROR, "")
            seen_columns.update(dict.fromkeys(row))
            if types is not None and not read_error:
                types.add(row)
            row[ROW_ID] = next_id
            if read_error:
                row[ERROR_COLUMN] = read_error
            if id_column is not None:
                if id_column not in row and not read_error:
                    raise JobError(f"input.id_column {id_column!r} is not a column of the input; "
                                   f"columns: {sorted(seen_columns)}")
                value = row.get(id_column)
                if is_missing(value) or value == "":
                    row.setdefault(ERROR_COLUMN, f"read: MissingIdError: the id column {id_column!r} is empty in this row")
                    keys.append(digest64(f"\0missing-{next_id}"))
                else:
                    keys.append(digest64(str(value)))
            next_id += 1
            writer.add(row)
    writer.flush()
    columns_list = list(seen_columns)
    if id_column is not None and keys:
        _check_duplicates(np.asarray(keys, dtype=np.uint64), tmp_dir, id_column)
    _publish(job, tmp_dir)
    return {"rows": next_id, "columns": columns_list,
            "column_types": types.result(columns_list) if types is not None else {}}


def _fresh_dirs(job: JobDir) -> Path:
    """An empty folder to stage ``input/`` in (and no ``input/`` left from before)."""
    if job.input_dir.exists():
        shutil.rmtree(job.input_dir)
    tmp_dir = job.root / ".input.tmp"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)
    return tmp_dir


def _publish(job: JobDir, tmp_dir: Path) -> None:
    """Put the staged files in place as ``input/``, durably."""
    fsync_dir(tmp_dir)
    os.replace(tmp_dir, job.input_dir)
    fsync_dir(job.root)


def _ingest_tables(job: JobDir, tables: Iterator[pa.Table], id_column: str | None) -> dict[str, Any]:
    """:func:`ingest` from Arrow tables of CSV text (``io.csv_tables``): the same files, ids
    and column types as the record path gives a clean file. Raises :class:`NotClean` where an
    id is empty or repeated (the record path says which)."""
    tmp_dir = _fresh_dirs(job)
    types = ColumnTypes()
    pending: list[pa.Table] = []
    pending_rows = part = next_id = 0
    names: list[str] = []
    keys: list[pa.ChunkedArray] = []

    def write(table: pa.Table) -> None:
        nonlocal part
        write_parquet_synced(table, tmp_dir / f"part-{part:05d}.parquet")
        part += 1

    for table in tables:
        names = names or table.column_names
        if id_column is not None and id_column not in table.column_names:
            raise JobError(f"input.id_column {id_column!r} is not a column of the input; columns: {sorted(names)}")
        types.add_table(table)
        ids = pa.array(np.arange(next_id, next_id + table.num_rows, dtype=np.int64))
        next_id += table.num_rows
        if id_column is None:
            key = pc.cast(ids, pa.string())
        else:
            key = table.column(id_column)
            if pc.any(pc.equal(key, "")).as_py():
                raise NotClean(f"an empty id in {id_column!r}")
            keys.append(key)
        pending.append(table.append_column(ROW_ID, ids).append_column(KEY_COLUMN, key))
        pending_rows += table.num_rows
        while pending_rows >= INGEST_ROWS:
            whole = pa.concat_tables(pending)
            write(whole.slice(0, INGEST_ROWS))
            pending = [whole.slice(INGEST_ROWS)]
            pending_rows -= INGEST_ROWS
    if pending_rows:
        write(pa.concat_tables(pending))
    if keys and pc.count_distinct(pa.chunked_array([c for k in keys for c in k.chunks])).as_py() != next_id:
        raise NotClean(f"repeated ids in {id_column!r}")
    _publish(job, tmp_dir)
    return {"rows": next_id, "columns": names, "column_types": types.result(names)}


def _check_duplicates(keys: np.ndarray, staged: Path, id_column: str) -> None:
    uniq, counts = np.unique(keys, return_counts=True)
    dup_hashes = set(uniq[counts > 1].tolist())
    if not dup_hashes:
        return
    examples: dict[str, int] = {}
    for f in sorted(staged.glob("part-*.parquet")):
        for text in pq.read_table(f, columns=[KEY_COLUMN]).column(0).to_pylist():
            if text is not None and digest64(text) in dup_hashes:
                examples[text] = examples.get(text, 0) + 1
    shown = ", ".join(f"{k!r} ({n} rows)" for k, n in list(examples.items())[:5])
    raise JobError(
        f"input.id_column {id_column!r} has duplicate values: {shown}"
        f"{' and more' if len(examples) > 5 else ''} ({len(dup_hashes)} duplicated ids in all). "
        "Ids must be unique: fix the input, pick another id_column, or drop id_column to use row positions."
    )


def todo_dataset(job: Job, todo: np.ndarray):
    """The input rows to send (``todo``), as a Ray Dataset of encoded rows (one block per input
    file; the processor cuts it into blocks of one engine batch)."""
    import ray
    import ray.data

    per_file = job.meta.ingest_rows or INGEST_ROWS
    files = []
    for path in job.dir.input_files():
        k = int(path.stem.split("-")[1])
        if todo[k * per_file:(k + 1) * per_file].any():
            files.append(str(path))
    todo_ref = ray.put(todo)

    def load(batch: pa.Table) -> pa.Table:
        mask = _todo_mask(todo_ref)
        return encode_rows([row for path in batch.column("path").to_pylist() for row in input_rows(Path(path), mask=mask)])

    ds = ray.data.from_items([{"path": f} for f in files], override_num_blocks=max(1, len(files)))
    return ds.map_batches(load, batch_size=1, batch_format="pyarrow", zero_copy_batch=True)


_TODO_CACHE: dict[str, np.ndarray] = {}


def _todo_mask(ref) -> np.ndarray:
    import ray

    key = ref.hex()
    if key not in _TODO_CACHE:
        _TODO_CACHE.clear()
        _TODO_CACHE[key] = ray.get(ref)
    return _TODO_CACHE[key]
