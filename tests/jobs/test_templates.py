"""Prompt templates over rows whose values are nested (JSONL objects and lists, Parquet structs):
``{meta.title}`` as in a Jinja template, ``{meta[title]}`` and ``{tags[0]}`` as in Python's
own format; a value's attributes are never read."""

from __future__ import annotations

import json

import pytest

from llmbatch.errors import ConfigError, RowValidationError
from llmbatch.jobs.ingest import input_rows
from llmbatch.jobs.kinds import job_for
from llmbatch.jobs.prompts import render
from llmbatch.jobs.run import open_job, read_input
from llmbatch.jobs.spec import load_job

ROWS = [
    {"id": 1, "meta": {"title": "Desk lamp", "tags": ["home", "light"]}, "review.text": "Bright.", "stars": 5},
    {"id": 2, "meta": {"title": "Kettle", "tags": ["kitchen"]}, "review.text": "Loud.", "stars": 2},
]


def staged(tmp_path, user: str) -> tuple:
    """The job's rows as its processor gets them: read from a JSONL file into the job directory."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    spec = load_job(data={"input": {"path": str(tmp_path / "in.jsonl"), "id_column": "id"},
                          "model": {"source": "smollm2-135m-instruct"}, "prompt": {"user": user},
                          "sampling_params": {"temperature": 0},
                          "output": {"path": str(tmp_path / "out.jsonl")}})
    job = job_for(spec)
    open_job(job)
    read_input(job)
    rows = [row for path in job.dir.input_files() for row in input_rows(path)]
    return job, sorted(rows, key=lambda r: r["id"])


def test_a_template_reads_into_a_rows_nested_values_and_a_column_named_with_a_dot(tmp_path):
    job, rows = staged(tmp_path, "{meta.title} ({meta[tags][0]}): {review.text} {stars:>3}")
    assert job.kind.fold_columns(job) == ["meta", "review.text", "stars"]  # the columns read, for the dedup
    texts = [job.preprocess()(row)["messages"][-1]["content"] for row in rows]
    assert texts == ["Desk lamp (home): Bright.   5", "Kettle (kitchen): Loud.   2"]


def test_a_nested_part_a_row_lacks_is_that_rows_error_and_an_attribute_is_never_read(tmp_path):
    job, rows = staged(tmp_path, "{meta.tags[1]}: {review.text}")
    assert job.preprocess()(rows[0])["messages"][-1]["content"] == "light: Bright."
    with pytest.raises(RowValidationError, match=r"\{meta.tags\[1\]\}: this row's list has 1 items, no \[1\]"):
        job.preprocess()(rows[1])
    row = {"review": "good", "meta": {"title": "T"}}
    with pytest.raises(RowValidationError, match=r"value is str, which has no field 'upper'"):
        render("{review.upper}", row)  # Python's format put "<built-in method upper ...>" in the prompt
    with pytest.raises(RowValidationError, match=r"'nope' is not a key of this row's value \(its keys: title\)"):
        render("{meta.nope}", row)
    assert render("{review} {meta[title]!r}", row) == "good 'T'"


def test_a_nested_field_whose_column_the_input_lacks_fails_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"the prompt uses \{info\}, which the input does not have"):
        staged(tmp_path, "{info.title}")
