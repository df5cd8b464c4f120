"""Running a chain of stages as one Ray Data operator.

:class:`StageRunner` is the callable class handed to ``Dataset.map_batches``. It holds an
asyncio loop on a thread of its own (the engine's home), runs its stages in order over each
batch, and yields rows as soon as the stages let go of them, so Ray Data moves them on while
the rest of the batch is still in the engine.

Between operators a row travels as one pickled value in :data:`STATE_COLUMN`, so that rows of
any shape (per-row sampling params, message lists, images) pass through Arrow untouched. The
first operator reads the user's columns; the last one turns rows into typed Arrow columns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pyarrow as pa

from llmbatch.rows import (
    ERROR_COLUMN,
    GENERATE_OUTPUT_COLUMNS,
    POOLING_OUTPUT_COLUMNS,
    PRIVATE_PREFIX,
    Row,
    is_error,
)
from llmbatch.stages.base import Stage
from llmbatch.stages.user_fns import PostprocessStage, default_output

logger = logging.getLogger(__name__)

STATE_COLUMN = "__llmbatch_state"

#: Arrow types of the engine's output columns, so that every block agrees on them.
OUTPUT_TYPES: dict[str, pa.DataType] = {
    "generated_text": pa.string(),
    "generated_tokens": pa.list_(pa.int64()),
    "num_input_tokens": pa.int64(),
    "num_generated_tokens": pa.int64(),
    "prompt": pa.string(),
    "finish_reason": pa.string(),
    "time_taken_llm": pa.float64(),
    "request_id": pa.int64(),
    "batch_uuid": pa.string(),
    "embeddings": pa.list_(pa.float32()),
    ERROR_COLUMN: pa.string(),
}


def empty_engine_output(task_type: str, row: Row) -> dict[str, Any]:
    """Engine columns of a row that never got an answer (an error row)."""
    columns = GENERATE_OUTPUT_COLUMNS if task_type == "generate" else POOLING_OUTPUT_COLUMNS
    defaults = {
        "generated_text": "", "generated_tokens": [], "num_input_tokens": 0, "num_generated_tokens": 0,
        "prompt": row.get("prompt") if isinstance(row.get("prompt"), str) else "",
        "finish_reason": "error", "time_taken_llm": 0.0, "request_id": -1, "batch_uuid": "", "embeddings": None,
    }
    return {c: defaults[c] for c in columns}


def _json_text(values: list[Any]) -> pa.Array:
    return pa.array([None if v is None else json.dumps(v, default=str) for v in values], type=pa.string())


def _column(name: str, values: list[Any], json_columns: set[str] | None = None) -> pa.Array:
    if json_columns is not None and name in json_columns:
        return _json_text(values)
    known = OUTPUT_TYPES.get(name)
    if known is not None:
        try:
            return pa.array(values, type=known)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            pass
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError, OverflowError):
        logger.warning("column %r holds values of mixed types; it is written as JSON text", name)
        if json_columns is not None:
            json_columns.add(name)
        return _json_text(values)


def rows_to_table(rows: list[dict[str, Any]], json_columns: set[str] | None = None) -> pa.Table:
    """Typed Arrow columns from dict rows (keys may differ between rows).

    A column whose values Arrow cannot hold in one type becomes JSON text; pass the same
    ``json_columns`` set for every batch of a stream so that such a column stays text for the
    rest of it (blocks of one dataset must agree on types)."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return pa.table({name: _column(name, [row.get(name) for row in rows], json_columns) for name in names})


def encode_rows(rows: list[Row]) -> pa.Table:
    return pa.table({STATE_COLUMN: pa.array([pickle.dumps(r, protocol=5) for r in rows], type=pa.binary())})


def decode_rows(batch: pa.Table) -> list[Row]:
    if STATE_COLUMN in batch.column_names:
        return [pickle.loads(v) for v in batch.column(STATE_COLUMN).to_pylist()]
    return batch.to_pylist()


class _LoopThread:
    """An asyncio loop on a daemon thread; sync code submits coroutines to it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="llmbatch-loop", daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen: AsyncIterator[Any]) -> Iterator[Any]:
        """Iterate an async generator from sync code (items arrive as the loop makes them)."""
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            try:
                self.run(agen.aclose())
            except Exception:  # noqa: BLE001 - closing a failed generator
                logger.debug("closing stage chain failed", exc_info=True)


class StageRunner:
    """A Ray Data callable class that runs ``stages`` over each batch (see module docstring).

    ``sink``: this is the last operator; rows leave as the user's output rows: typed columns,
    or, with ``sink_rows``, still encoded (the job driver types them when it commits).
    ``keep_private``: private keys to keep in the sink's output (the job layer's row ids).
    """

    def __init__(self, stages: list[Stage], *, sink: bool = False, sink_rows: bool = False,
                 task_type: str = "generate", include_error_column: bool = True,
                 keep_private: tuple[str, ...] = ()):
        self.stages = stages
        self.sink = sink
        self.sink_rows = sink_rows
        self._json_columns: set[str] = set()
        self.task_type = task_type
        self.include_error_column = include_error_column
        self.keep_private = keep_private
        self._loop = _LoopThread()
        for stage in stages:
            self._loop.run(stage.start())

    async def _chain(self, rows: list[Row], index: int) -> AsyncIterator[list[Row]]:
        if index == len(self.stages):
            yield rows
            return
        async for chunk in self.stages[index](rows):
            async for out in self._chain(chunk, index + 1):
                yield out

    def _output_row(self, row: Row) -> dict[str, Any]:
        private = {k: row[k] for k in self.keep_private if k in row}
        if is_error(row):
            out = default_output(row)
            for key, value in empty_engine_output(self.task_type, row).items():
                out.setdefault(key, value)
            out.update(private)
            return out
        if any(isinstance(s, PostprocessStage) for s in self.stages):
            out = {k: v for k, v in row.items() if not k.startswith(PRIVATE_PREFIX)}
            if not self.include_error_column:
                out.pop(ERROR_COLUMN, None)
        else:
            out = default_output(row)
            out.setdefault(ERROR_COLUMN, "")
        out.update(private)
        return out

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        rows = decode_rows(batch)
        for chunk in self._loop.iterate(self._chain(rows, 0)):
            if not chunk:
                continue
            if self.sink and self.sink_rows:
                yield encode_rows([self._output_row(r) for r in chunk])
            elif self.sink:
                yield rows_to_table([self._output_row(r) for r in chunk], self._json_columns)
            else:
                yield encode_rows(chunk)

    def __del__(self):
        loop = getattr(self, "_loop", None)
        if loop is None:
            return
        for stage in getattr(self, "stages", []):
            try:
                loop.run(stage.close())
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
