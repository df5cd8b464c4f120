"""Tally counts a part a column at a time: the same counts as one row at a time."""

from __future__ import annotations

import random

from llmbatch.codec import rows_to_table
from llmbatch.jobs.tally import Tally
from llmbatch.rows import ERROR_COLUMN, STATS


def rows(seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(300):
        error = rng.choice(["", "", "", "engine: ValueError: no", "validate: RowValidationError: long", None])
        stats = None if rng.random() < 0.2 else {
            "replica": rng.choice(["r0", "r1", None, ""]), "deduped": rng.choice([True, False, None]),
            "cached_tokens": rng.choice([None, 0, 7]), "restarts": rng.choice([0, 1, 2, None]),
            "ready_at": rng.choice([None, 0.0, 100.5, 101.25]), "start_at": rng.choice([None, 90.0, 91.0]),
            "first_request_at": rng.choice([None, 102.0, 103.5])}
        out.append({"id": i, ERROR_COLUMN: error, "num_input_tokens": rng.choice([None, 3, 12]),
                    "num_generated_tokens": rng.choice([None, 0, 5]), STATS: stats})
    return out


def counts(t: Tally) -> dict:
    return {**t.progress_counts(), "cached_reported": t.cached_reported, "restarts": t.restarts,
            "ready_at": min(t.ready_at, default=None), "start_at": min(t.start_at, default=None),
            "first_request_at": min(t.first_request_at, default=None)}


def test_column_counts_equal_row_counts():
    for seed in range(5):
        table = rows_to_table(rows(seed))
        by_column, by_row = Tally(), Tally()
        by_column.add(table)
        by_row._add_rows(table)
        assert counts(by_column) == counts(by_row), seed
        assert by_column.ok + by_column.errors == table.num_rows


def test_tables_without_stats_or_errors_count():
    table = rows_to_table([{"x": 1, "num_generated_tokens": 4}, {"x": 2, "num_generated_tokens": None}])
    t = Tally()
    t.add(table)
    assert (t.ok, t.errors, t.delivered_tokens, t.generated_tokens, t.deduplicated_rows) == (2, 0, 4, 4, 0)
