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
