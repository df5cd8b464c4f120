"""Writing job outputs: Parquet, JSON Lines or CSV, streamed and swapped into place at once.

Blocks of one output may disagree on a column's type (an all-null block, ints in one part and
floats in the next): :func:`unify_schema` picks one type per column, widening where Arrow can
and falling back to JSON text where it cannot, and every block is cast to it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from llmbatch.errors import ConfigError
from llmbatch.io.files import fsync_dir


def unify_schema(schemas: list[pa.Schema], columns: list[str]) -> pa.Schema:
    """One schema for ``columns`` across ``schemas``."""
    fields = []
    for name in columns:
        types = [s.field(name).type for s in schemas if name in s.names]
        types = [t for t in types if not pa.types.is_null(t)] or [pa.null()]
        chosen = types[0]
        for other in types[1:]:
            if other == chosen:
                continue
            if _list_like(chosen) and _list_like(other) and chosen.value_type == other.value_type:
                chosen = pa.list_(chosen.value_type)  # vectors of different lengths: a plain list
                continue
            try:
                chosen = pa.unify_schemas([pa.schema([(name, chosen)]), pa.schema([(name, other)])],
                                          promote_options="permissive").field(name).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                chosen = pa.string()
                break
        fields.append(pa.field(name, pa.string() if pa.types.is_null(chosen) else chosen))
    return pa.schema(fields)


def _list_like(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t)


def _as_json_text(array: pa.Array) -> pa.Array:
    return pa.array([None if v is None else (v if isinstance(v, str) else json.dumps(v, default=str))
                     for v in array.to_pylist()], pa.string())


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns and types (missing columns are null)."""
    arrays = []
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name).combine_chunks()
            if col.type != field.type:
                try:
                    col = pc.cast(col, field.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    if field.type != pa.string():
                        raise
                    col = _as_json_text(col)
        else:
            col = pa.nulls(table.num_rows, field.type)
        arrays.append(col)
    return pa.Table.from_arrays(arrays, schema=schema)


def _flat_for_csv(table: pa.Table) -> pa.Table:
    cols = []
    for col in table.columns:
        if pa.types.is_nested(col.type):
            col = _as_json_text(col.combine_chunks())
        cols.append(col)
    return pa.Table.from_arrays(cols, names=table.column_names)


class OutputWriter:
    """Streams tables into one output file beside its final name; :meth:`finish` completes
    and fsyncs it, :meth:`commit` moves it into place (a rename). A remote (fsspec) output is
    written in place, as object stores have no rename."""

    def __init__(self, path: str, fmt: str, schema: pa.Schema):
        if fmt not in ("parquet", "jsonl", "csv"):
            raise ConfigError(f"unknown output format {fmt!r}; use parquet, jsonl or csv")
        self.path = path
        self.fmt = fmt
        self.schema = schema
        self.remote = "://" in path and not path.startswith("file://")
        self.rows = 0
        if self.remote:
            import fsspec

            self._fh = fsspec.open(path, "wb").open()
            self._tmp = None
        else:
            local = path.removeprefix("file://")
            os.makedirs(os.path.dirname(os.path.abspath(local)) or ".", exist_ok=True)
            self._tmp = os.path.join(os.path.dirname(os.path.abspath(local)), f".{os.path.basename(local)}.tmp")
            self._fh = open(self._tmp, "wb")
        self._writer: Any = None
        if fmt == "parquet":
            import pyarrow.parquet as pq

            self._writer = pq.ParquetWriter(self._fh, schema)
        elif fmt == "csv":
            import pyarrow.csv as pacsv

            self._writer = pacsv.CSVWriter(self._fh, _flat_for_csv(schema.empty_table()).schema)

    def write(self, table: pa.Table) -> None:
        table = conform(table, self.schema)
        self.rows += table.num_rows
        if self.fmt == "parquet":
            self._writer.write_table(table)
        elif self.fmt == "csv":
            self._writer.write_table(_flat_for_csv(table))
        else:
            lines = [json.dumps(row, ensure_ascii=False, default=str) for row in table.to_pylist()]
            if lines:
                self._fh.write(("\n".join(lines) + "\n").encode("utf-8"))

    def finish(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._fh.flush()
        if not self.remote:
            os.fsync(self._fh.fileno())
        self._fh.close()

    def commit(self) -> str:
        if self._tmp is not None:
            final = self.path.removeprefix("file://")
            os.replace(self._tmp, final)
            fsync_dir(os.path.dirname(os.path.abspath(final)) or ".")
        return self.path

    def close(self) -> str:
        self.finish()
        return self.commit()

    def abort(self) -> None:
        try:
            self._fh.close()
        finally:
            if self._tmp is not None and os.path.exists(self._tmp):
                os.unlink(self._tmp)
