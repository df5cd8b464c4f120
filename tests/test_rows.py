"""The row contract: the output columns, declared once, and what is derived from them."""

from __future__ import annotations

import pyarrow as pa

from llmbatch.codec import OUTPUT_TYPES, VECTOR_COLUMNS, empty_engine_output, rows_to_table
from llmbatch.rows import ERROR_COLUMN, OUTPUT_COLUMNS, TASK_OUTPUT_COLUMNS


def test_every_output_column_has_its_type_and_error_value_from_the_one_declaration():
    declared = {c.name for c in OUTPUT_COLUMNS}
    assert set(OUTPUT_TYPES) == {c.name for c in OUTPUT_COLUMNS if c.arrow} | {ERROR_COLUMN}
    assert set(VECTOR_COLUMNS) == {"embeddings", "probs"}
    for task, columns in TASK_OUTPUT_COLUMNS.items():
        assert set(columns) <= declared
        error_row = empty_engine_output(task, {"prompt": "p"})
        assert tuple(error_row) == columns
        table = rows_to_table([error_row])  # an error row's values fit the columns' types
        for name in columns:
            if name in OUTPUT_TYPES and error_row[name] is not None:
                assert table.schema.field(name).type == OUTPUT_TYPES[name], name
    assert TASK_OUTPUT_COLUMNS["classify"][-2:] == ("probs", "label")
    assert empty_engine_output("generate", {})["generated_tokens"] is not empty_engine_output("generate", {})[
        "generated_tokens"]  # a fresh list per row
    assert isinstance(OUTPUT_TYPES["generated_tokens"], pa.ListType)
