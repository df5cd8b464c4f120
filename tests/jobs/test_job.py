"""The Job object: built once, its processor config resolved once, and its kind chosen by what
its input is."""

from __future__ import annotations

import json

from llmbatch.jobs.driver import answer_tag, build_job_processor
from llmbatch.jobs.identity import config_hash, result_fields
from llmbatch.jobs.kinds import OpenAIBatchKind, RowsKind, job_for
from llmbatch.jobs.spec import JobSpec, load_job


def rows_spec(tmp_path):
    (tmp_path / "data.csv").write_text("Index,Company\n1,Acme\n")
    return load_job(data={"input": {"path": str(tmp_path / "data.csv"), "id_column": "Index"},
                          "model": {"source": "smollm2-135m-instruct", "engine_kwargs": {"max_model_len": 512}},
                          "prompt": {"user": "Which industry is {Company} in?"},
                          "output": {"path": str(tmp_path / "out.parquet")}})


def batch_spec(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "smollm2-135m-instruct",
                                         "messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    return load_job(data={"input": {"path": str(path), "format": "openai-batch"},
                          "output": {"path": str(tmp_path / "results.jsonl")}})


def test_the_processor_config_is_resolved_once_per_job(tmp_path, monkeypatch):
    job = job_for(rows_spec(tmp_path))
    calls = []
    resolve = JobSpec.processor_config
    monkeypatch.setattr(JobSpec, "processor_config", lambda self: calls.append(1) or resolve(self))
    for _ in range(3):  # a run's passes, each building its processor
        build_job_processor(job)
    assert job.task == "generate" and job.config.model_source == "smollm2-135m-instruct"
    assert len(calls) == 1


def test_the_kind_follows_the_input_and_adds_its_own_identity_fields(tmp_path):
    rows = job_for(rows_spec(tmp_path))
    batch = job_for(batch_spec(tmp_path))
    assert isinstance(rows.kind, RowsKind) and isinstance(batch.kind, OpenAIBatchKind)
    # a rows job's identity is the spec's alone, so its existing job directories resume
    assert rows.result_fields == result_fields(rows.spec)
    assert config_hash(rows.result_fields) == config_hash(result_fields(rows.spec))
    assert batch.result_fields["input.invalid_lines"] == "fail" and "input.invalid_lines" not in rows.result_fields
    assert answer_tag(rows) != answer_tag(batch)
    # the kind's own files are checked before a run: the batch's error file beside its output
    assert [flag for _, flag in batch.kind.outputs(batch)] == ["--output (output.path)", "--errors (output.errors_path)"]
    assert [flag for _, flag in rows.kind.outputs(rows)] == ["--output (output.path)"]
    request = batch.preprocess()({"url": "/v1/chat/completions", "model": "smollm2-135m-instruct",
                                  "body": json.dumps({"messages": [{"role": "user", "content": "hi"}]})})
    assert request["messages"] == [{"role": "user", "content": "hi"}]
    assert rows.preprocess()({"Company": "Acme"})["messages"][-1]["content"] == "Which industry is Acme in?"
    assert batch.postprocess() is not None and rows.postprocess() is None


def test_the_first_answered_part_checks_the_output_columns_and_renames_of_its_rows(tmp_path):
    """``output.first_part_check``: a part of error rows only is passed over; the first with an
    answer fails for a named column it lacks (prompt templates only: a function's rows may differ)
    or two columns renamed to one name (any rows); a part that passes ends the checking."""
    import pyarrow as pa
    import pytest

    from llmbatch.errors import ConfigError
    from llmbatch.jobs.output import check_rename, first_part_check
    from llmbatch.rows import ERROR_COLUMN

    spec = rows_spec(tmp_path)
    assert first_part_check(job_for(spec)) is None  # neither columns nor rename: nothing to check
    answered = pa.table({"Index": ["1", "2"], "Company": ["Acme", "Bolt"], "generated_text": ["x", None],
                         ERROR_COLUMN: [None, "engine: boom"]})
    errors_only = answered.slice(1)
    spec.output.columns = ["Index", "generated_txt"]
    check = first_part_check(job_for(spec))
    assert check(errors_only) is False
    with pytest.raises(ConfigError, match=r"names \['generated_txt'\], which the answered rows do not have; "
                                          r"they have \['Company', 'Index', 'generated_text'\]"):
        check(answered)
    spec.output.columns = ["Index", "industry"]
    spec.output.rename = {"generated_text": "industry"}
    assert first_part_check(job_for(spec))(answered) is True
    spec.output.columns, spec.output.rename = None, {"generated_text": "label"}  # another task's column name:
    check_rename(spec, ["Index", "Company"])  # free for a generation job (only the input's are known before)
    assert first_part_check(job_for(spec))(answered) is True
    data = {**spec.model_dump(include={"input", "model"}), "preprocess": "hooks:request",  # a function's rows
            "output": {"path": str(tmp_path / "out.parquet"), "columns": ["Index", "generated_txt"]}}
    assert first_part_check(job_for(load_job(data=data)))(answered) is True  # only the renames are checked
    data["output"]["rename"] = {"generated_text": "Company"}
    with pytest.raises(ConfigError, match="gives two columns the name 'Company': 'generated_text' -> 'Company', "
                                          "and the column 'Company' itself"):
        first_part_check(job_for(load_job(data=data)))(answered)
