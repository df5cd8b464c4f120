"""The last stage of every processor: the shape of the output rows.

Every layout ends with an :class:`OutputStage` (``Layout.output``), run by the last operator:
the public ``build_processor`` puts the user's (typed Arrow columns, no private keys, the
request fields the engine consumed dropped unless postprocess returned them); the job layer
passes its own to ``builders.build_layout`` (the private keys its driver needs, every row's
error column, the job's JSON columns as text: typed as the driver commits them, so the
replicas type their rows, not the driver's one thread). The runner and the layout know nothing of either: the
last stage of an operator says what leaves it (:meth:`~llmbatch.stages.base.Stage.to_table`).

The stage passes rows through untouched on the runner's loop (the engine's home); the shaping
runs where the runner turns them into the operator's output, as they leave.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import pyarrow as pa

from llmbatch.codec import JOB_JSON_COLUMNS, empty_engine_output, rows_to_table
from llmbatch.rows import ERROR_COLUMN, PRIVATE_PREFIX, Row, is_error
from llmbatch.stages.base import Stage
from llmbatch.stages.user_fns import default_output


class OutputStage(Stage):
    """Shapes the rows that leave the processor.

    ``keep_private``: private keys the output keeps (the job layer's row ids, per-row engine
    facts); ``for_job``: the rows go to a job's driver, which commits them as they come (every
    row keeps its error column, the row's state, and :data:`~llmbatch.codec.JOB_JSON_COLUMNS`
    are JSON text from the first row on). Rows leave as typed Arrow columns either way.
    :meth:`bind` gives it what the layout decides (the task, whether errors are kept, whether a
    postprocess shaped the rows)."""

    name = "output"

    def __init__(self, *, keep_private: tuple[str, ...] = (), for_job: bool = False):
        super().__init__()
        self.keep_private = tuple(keep_private)
        self.for_job = for_job
        self.task_type = "generate"
        self.continue_on_error = True
        self.postprocessed = False
        self._json_columns: set[str] = set()

    def bind(self, *, task_type: str, continue_on_error: bool, postprocessed: bool) -> OutputStage:
        """This stage for one layout: a copy that knows its task, whether error rows travel on
        and whether the user's postprocess made the rows."""
        bound = copy.copy(self)
        bound.task_type, bound.continue_on_error, bound.postprocessed = task_type, continue_on_error, postprocessed
        bound._json_columns = set(JOB_JSON_COLUMNS) if self.for_job else set()
        return bound

    async def __call__(self, rows: list[Row]) -> AsyncIterator[list[Row]]:
        yield rows  # shaped in to_table, off the loop

    def shape(self, row: Row) -> dict[str, Any]:
        """One output row."""
        private = {k: row[k] for k in self.keep_private if k in row}
        if is_error(row):
            out = default_output(row)
            for key, value in empty_engine_output(self.task_type, row).items():
                out.setdefault(key, value)
        elif self.postprocessed:
            out = {k: v for k, v in row.items() if not k.startswith(PRIVATE_PREFIX)}
            # a job's driver reads every row's error column: the row's state
            if not self.continue_on_error and not self.for_job:
                out.pop(ERROR_COLUMN, None)
        else:
            out = default_output(row)
            out.setdefault(ERROR_COLUMN, "")
        out.update(private)
        return out

    def to_table(self, rows: list[Row]) -> pa.Table:
        shaped = [self.shape(r) for r in rows]
        return rows_to_table(shaped, self._json_columns)
