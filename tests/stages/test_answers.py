"""Answer records (stages/answers.py) and reading them back from a job's parts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from llmbatch.jobs.store import committed_answers
from llmbatch.rows import ANSWER, ERROR_COLUMN, ROW_ID
from llmbatch.stages.answers import MAX_ANSWER_BYTES, answer_record, load_known, read_record

KEY = bytes(range(16))


def test_a_record_reads_back_under_its_tag_only_and_leaves_the_prompt_out():
    text = answer_record("t1", KEY, {"prompt": "long prompt", "generated_tokens": [1, 2], "finish_reason": "stop"})
    assert read_record(text, "t1") == (KEY, {"generated_tokens": [1, 2], "finish_reason": "stop"})
    assert read_record(text, "t2") is None  # made under other model settings: recomputed
    assert read_record("{not json", "t1") is None


def test_answers_that_are_not_plain_json_or_too_big_are_not_recorded():
    assert answer_record("t", KEY, {"embeddings": np.zeros(3, dtype=np.float32)}) is None
    assert answer_record("t", KEY, {"generated_text": "x" * (MAX_ANSWER_BYTES + 1)}) is None
    assert load_known(None) == {} and load_known({KEY: {}}) == {KEY: {}}


class _Parts:
    def __init__(self, paths, journal=None):
        self.paths = paths
        self.journal_dir = journal if journal is not None else paths[0].parent / "no-journal"

    def part_files(self):
        return self.paths


def test_committed_answers_skip_error_rows_other_tags_and_parts_without_records(tmp_path):
    good = answer_record("t", KEY, {"generated_tokens": [5]})
    other = answer_record("old", bytes(16), {"generated_tokens": [6]})
    failed = answer_record("t", b"\x01" * 16, {"generated_tokens": [7]})
    pq.write_table(pa.table({ROW_ID: [0, 1, 2, 3], ANSWER: [good, other, failed, None],
                             ERROR_COLUMN: ["", "", "engine: X: y", ""]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({ROW_ID: [4], ERROR_COLUMN: ["preprocess: E: z"]}), tmp_path / "b.parquet")
    parts = _Parts([tmp_path / "b.parquet", tmp_path / "a.parquet"])
    assert committed_answers(parts, "t") == {KEY: {"generated_tokens": [5]}}
    assert committed_answers(parts, "t", limit_bytes=10) == {}  # bounded: the rest is recomputed


def test_the_answer_journal_is_read_with_the_parts_and_a_line_cut_by_a_kill_is_skipped(tmp_path):
    # answers a killed run made before their rows were committed (stages/engine.py appends each)
    committed = answer_record("t", KEY, {"generated_tokens": [5]})
    pq.write_table(pa.table({ROW_ID: [0], ANSWER: [committed], ERROR_COLUMN: [""]}), tmp_path / "a.parquet")
    journal = tmp_path / "answers"
    journal.mkdir()
    made = [answer_record("t", bytes([i]) * 16, {"generated_tokens": [i]}) for i in range(3)]
    other = answer_record("old", b"\x09" * 16, {"generated_tokens": [9]})
    (journal / "host-1-a").write_text(made[0] + "\n" + other + "\n" + made[1] + "\n" + made[2][:-7])  # killed mid-line
    (journal / "host-2-b").write_text(committed + "\n")
    known = committed_answers(_Parts([tmp_path / "a.parquet"], journal), "t")
    assert known == {KEY: {"generated_tokens": [5]}, bytes([0]) * 16: {"generated_tokens": [0]},
                     bytes([1]) * 16: {"generated_tokens": [1]}}
