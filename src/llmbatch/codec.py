"""The row codec: how rows travel between operators and how they rest on disk.

Two forms, one module:

- **In flight** (between the processor's Ray Data operators): a row of any shape (per-row
  sampling params, message lists, images) travels as one pickled value in
  :data:`STATE_COLUMN`, so it passes through Arrow untouched. This form lives only in Ray's
  object store, never on disk.
- **At rest** (a job's staged input and committed parts): typed Arrow columns. A column whose
  values Arrow cannot hold in one type is stored as JSON text and its field is marked
  (:data:`JSON_FIELD_KEY`), so reading it back gives the same values. Nothing at rest is a
  pickle: a job directory holds data, never code.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import pickle
import sys
import sysconfig
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from llmbatch.rows import (
    ERROR_COLUMN,
    GENERATE_OUTPUT_COLUMNS,
    HTTP_OUTPUT_COLUMNS,
    OUTPUT_COLUMNS,
    TASK_OUTPUT_COLUMNS,
    Row,
)

logger = logging.getLogger(__name__)

STATE_COLUMN = "__llmbatch_state"
#: Field metadata that marks a column stored as JSON text.
JSON_FIELD_KEY = b"llmbatch.json"
#: Columns a job keeps as JSON text from its first row (free-form JSON: the conversation, an
#: endpoint's whole answer), so that every part of a job agrees on them.
JOB_JSON_COLUMNS = frozenset({"messages", "http_response", "completions"})

_ARROW = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(),
          "list<int64>": pa.list_(pa.int64()), "list<float32>": pa.list_(pa.float32())}
#: Arrow types of the engine's output columns (:data:`llmbatch.rows.OUTPUT_COLUMNS`), so that
#: every block agrees on them.
OUTPUT_TYPES: dict[str, pa.DataType] = {
    **{c.name: _ARROW[c.arrow] for c in OUTPUT_COLUMNS if c.arrow}, ERROR_COLUMN: pa.string()}
#: Vector columns stored as fixed-size lists when every row of a block has the same length.
VECTOR_COLUMNS = tuple(c.name for c in OUTPUT_COLUMNS if c.vector)
_EMPTY = {c.name: c.empty for c in OUTPUT_COLUMNS}


def empty_engine_output(task_type: str, row: Row) -> dict[str, Any]:
    """Engine columns of a row that never got an answer (an error row).

    ``task_type`` "endpoint" (HTTP, Ray Serve): the endpoint columns, and the generate columns
    too for a row that asked with ``messages``/``prompt`` rather than its own request."""
    if task_type == "endpoint":
        columns = HTTP_OUTPUT_COLUMNS
        if "request_kwargs" in row:  # a Serve deployment's response fields are merged into the row
            columns = tuple(c for c in columns if c != "http_response")
        elif "payload" not in row:
            columns = tuple(dict.fromkeys(GENERATE_OUTPUT_COLUMNS + columns))
    else:
        columns = TASK_OUTPUT_COLUMNS[task_type]
    out = {c: list(_EMPTY[c]) if isinstance(_EMPTY[c], tuple) else _EMPTY[c] for c in columns}
    if "prompt" in out and isinstance(row.get("prompt"), str):
        out["prompt"] = row["prompt"]  # the prompt the row had
    return out


# ---------------------------------------------------------------------------- in flight


def encode_rows(rows: list[Row]) -> pa.Table:
    """Rows as one pickled value each (between operators only; never written to disk)."""
    return pa.table({STATE_COLUMN: pa.array([pickle.dumps(r, protocol=5) for r in rows], type=pa.binary())})


def decode_rows(batch: pa.Table) -> list[Row]:
    """The rows of an operator's input: encoded rows, or the user's plain columns."""
    if STATE_COLUMN in batch.column_names:
        return [pickle.loads(v) for v in batch.column(STATE_COLUMN).to_pylist()]
    return table_to_rows(batch)


# ---------------------------------------------------------------------------- at rest


def _json_text(values: list[Any]) -> pa.Array:
    return pa.array([None if v is None else json.dumps(v, default=str) for v in values], type=pa.string())


def _column(name: str, values: list[Any], json_columns: set[str] | None) -> tuple[pa.Array, bool]:
    """(array, stored as JSON text)."""
    if json_columns is not None and name in json_columns:
        return _json_text(values), True
    known = OUTPUT_TYPES.get(name)
    if name in VECTOR_COLUMNS:
        lengths = {len(v) for v in values if v is not None}
        if len(lengths) == 1 and lengths != {0}:
            known = pa.list_(pa.float32(), lengths.pop())  # fixed size: one vector length
    if known is not None:
        try:
            return pa.array(values, type=known), False
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            pass
    try:
        return pa.array(values), False
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError, OverflowError):
        logger.debug("column %r holds values of mixed types; it is stored as JSON text", name)
        if json_columns is not None:
            json_columns.add(name)
        return _json_text(values), True


def rows_to_table(rows: list[dict[str, Any]], json_columns: set[str] | None = None) -> pa.Table:
    """Typed Arrow columns from dict rows (keys may differ between rows).

    A column whose values Arrow cannot hold in one type becomes JSON text, marked in its
    field's metadata; pass the same ``json_columns`` set for every batch of a stream so that
    such a column stays text for the rest of it (blocks of one dataset must agree on types).
    """
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    arrays, fields = [], []
    for name in names:
        array, as_json = _column(name, [row.get(name) for row in rows], json_columns)
        arrays.append(array)
        fields.append(pa.field(name, array.type, metadata={JSON_FIELD_KEY: b"1"} if as_json else None))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def json_columns_of(schema: pa.Schema) -> list[str]:
    """Columns of ``schema`` stored as JSON text by :func:`rows_to_table`."""
    return [f.name for f in schema if f.metadata and f.metadata.get(JSON_FIELD_KEY)]


def table_to_rows(table: pa.Table) -> list[Row]:
    """Rows back from :func:`rows_to_table` (JSON text columns decoded)."""
    rows = table.to_pylist()
    marked = json_columns_of(table.schema)
    for row in rows:
        for name in marked:
            if row.get(name) is not None:
                row[name] = json.loads(row[name])
    return rows


def has_text(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Whether each cell of a text column holds a non-empty text (a null or ``""`` does not):
    the failed rows of an error column, the rows of a part that carry an answer record."""
    import pyarrow.compute as pc

    if pa.types.is_null(column.type):
        return np.zeros(len(column), dtype=bool)
    flags = pc.fill_null(pc.not_equal(column.cast(pa.string()), ""), False)
    return np.asarray(flags.to_numpy(zero_copy_only=False), dtype=bool)


def digest64(text: str) -> int:
    """A stable 64-bit digest of ``text`` (ids, request keys)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


# ---------------------------------------------------------------------------- user functions


def _is_local(name: str, module: Any) -> bool:
    """A module the workers may not be able to import (a script's helper, a test file, a
    job's module): not installed, not the standard library, not llmbatch, not ``__main__``."""
    if module is None or name == "__main__" or name.startswith("llmbatch"):
        return False
    origin = getattr(module, "__file__", None) or ""
    if not origin or "site-packages" in origin or "dist-packages" in origin:
        return False
    if origin.startswith(_STDLIB):
        return False
    # installed elsewhere (pip install --target, a PYTHONPATH folder of wheels): it has a
    # distribution, so the workers import it as the driver did
    return name.partition(".")[0] not in _installed_packages()


_STDLIB = sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=1)
def _installed_packages() -> frozenset[str]:
    """Top-level package names that belong to an installed distribution (on any sys.path entry)."""
    import importlib.metadata

    try:
        return frozenset(importlib.metadata.packages_distributions())
    except Exception:  # noqa: BLE001 - a broken dist-info must not stop a job; fall back to paths
        return frozenset()


def _cloudpickle():
    try:  # Ray serializes with its own copy of cloudpickle
        from ray import cloudpickle
    except ImportError:  # pragma: no cover - ray is a dependency
        import cloudpickle
    return cloudpickle


def _dumps_by_value(fn: Callable) -> bytes:
    """``fn`` pickled with the code of every local module it reaches (a wrapper's function, the
    helpers a job's module imports), registered for this one pickling only."""
    cp = _cloudpickle()
    already = set(cp.list_registry_pickle_by_value())
    local = [m for name, m in list(sys.modules.items()) if name not in already and _is_local(name, m)]
    for module in local:
        cp.register_pickle_by_value(module)
    try:
        return cp.dumps(fn)
    finally:
        for module in local:
            cp.unregister_pickle_by_value(module)


def _loads(data: bytes) -> Callable:
    return _cloudpickle().loads(data)


class ByValue:
    """A user function that travels to the workers with its module's code when that module
    is not installed there. The module is pickled by value only while this function is
    pickled: nothing global changes when a processor is built."""

    def __init__(self, fn: Callable):
        self.fn = fn.fn if isinstance(fn, ByValue) else fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return (_from_bytes, (_dumps_by_value(self.fn),))


def _from_bytes(data: bytes) -> ByValue:
    return ByValue(_loads(data))

