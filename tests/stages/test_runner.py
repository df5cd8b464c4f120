"""StageRunner: the output shapes of the last operator, and its heartbeat."""

from __future__ import annotations

import pyarrow as pa

from llmbatch.codec import STATE_COLUMN, decode_rows
from llmbatch.rows import ERROR_COLUMN, ROW_ID, STATS
from llmbatch.stages.base import Stage
from llmbatch.stages.runner import StageRunner


class Answer(Stage):
    name = "engine"

    def process_row(self, row):
        if row["q"] == "bad":
            raise ValueError("cannot answer")
        row.update(generated_text=row["q"].upper(), num_input_tokens=1, num_generated_tokens=1,
                   sampling_params={"max_tokens": 1}, **{STATS: {"replica": "r"}})


def run(runner, table):
    return list(runner(table))


def test_user_sink_gives_typed_columns_without_request_fields():
    runner = StageRunner([Answer()], sink=True, continue_on_error=True)
    out = pa.concat_tables(run(runner, pa.table({"q": ["a", "bad"], "keep": [1, 2]})))
    rows = out.to_pylist()
    assert "sampling_params" not in out.column_names and STATS not in out.column_names
    assert rows[0]["generated_text"] == "A" and rows[0]["keep"] == 1 and rows[0][ERROR_COLUMN] == ""
    assert rows[1][ERROR_COLUMN] == "engine: ValueError: cannot answer" and rows[1]["finish_reason"] == "error"


def test_middle_operators_pass_encoded_rows_and_the_job_sink_keeps_its_private_columns():
    middle = StageRunner([Answer()], continue_on_error=True)
    (table,) = run(middle, pa.table({"q": ["a"], ROW_ID: [7]}))
    assert table.column_names == [STATE_COLUMN]
    job_sink = StageRunner([], sink=True, encoded_output=True, keep_private=(ROW_ID, STATS))
    (out,) = run(job_sink, table)
    (row,) = decode_rows(out)
    assert row[ROW_ID] == 7 and row[STATS] == {"replica": "r"} and row["generated_text"] == "A"


def test_heartbeat_probe_says_ready_after_start():
    runner = StageRunner([Answer()])
    assert runner._probe() == {"state": "ready", "waiting_since": 0.0, "in_flight": 0, "done": 0}
