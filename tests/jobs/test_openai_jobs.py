"""Jobs whose input is an OpenAI batch file: what the job file needs, and what it infers."""

from __future__ import annotations

import json

import pytest

from llmbatch.errors import ConfigError
from llmbatch.jobs.kinds import job_for
from llmbatch.jobs.openai_batch import errors_path, served_names
from llmbatch.jobs.spec import load_job


def write(tmp_path, url="/v1/chat/completions", model="smollm2-135m-instruct"):
    body = {"model": model, "input": "x"} if url == "/v1/embeddings" else {"model": model, "messages": []}
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}) + "\n")
    return str(path)


def test_a_batch_job_needs_no_prompt_and_takes_its_model_from_the_file(tmp_path):
    spec = load_job(data={"input": {"path": write(tmp_path), "format": "openai-batch"},
                          "output": {"path": str(tmp_path / "results.jsonl")}})
    assert spec.model.source == "smollm2-135m-instruct" and spec.output.format == "openai-batch"
    assert errors_path(spec) == str(tmp_path / "results.errors.jsonl")
    assert served_names(spec) == ["smollm2-135m-instruct"]
    assert job_for(spec).result_fields["input.invalid_lines"] == "fail"


def test_an_embedding_model_or_file_runs_as_embed(tmp_path):
    spec = load_job(data={"input": {"path": write(tmp_path, "/v1/embeddings", "all-minilm-l6-v2"),
                                    "format": "openai-batch"}, "output": {"path": str(tmp_path / "v.jsonl")}})
    assert spec.processor_config().task_type == "embed"


@pytest.mark.parametrize("extra,message", [
    ({"prompt": {"user": "{x}"}}, "leave out prompt"),
    ({"input": {"id_column": "custom_id"}}, "no id_column"),
])
def test_a_batch_job_refuses_what_its_lines_already_say(tmp_path, extra, message):
    data = {"input": {"path": write(tmp_path), "format": "openai-batch"}, "output": {"path": str(tmp_path / "r.jsonl")}}
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value}
    with pytest.raises(ConfigError, match=message):
        load_job(data=data)


def test_openai_output_needs_openai_input(tmp_path):
    (tmp_path / "d.csv").write_text("a\n1\n")
    with pytest.raises(ConfigError, match="needs input.format openai-batch"):
        load_job(data={"input": {"path": str(tmp_path / "d.csv")}, "model": {"source": "smollm2-135m-instruct"},
                       "prompt": {"user": "{a}"}, "output": {"path": str(tmp_path / "o.jsonl"), "format": "openai-batch"}})


def test_a_line_naming_a_served_name_asks_the_base_model_not_an_adapter_of_that_name(tmp_path):
    spec = load_job(data={"input": {"path": write(tmp_path, model="team-llm"), "format": "openai-batch"},
                          "model": {"source": "smollm2-135m-instruct", "served_model_name": ["team-llm", "alt"]},
                          "output": {"path": str(tmp_path / "results.jsonl")}})
    pre = job_for(spec).preprocess()
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for name in ("team-llm", "alt", "smollm2-135m-instruct"):
        row = {"url": "/v1/chat/completions", "model": name, "body": json.dumps({**body, "model": name})}
        assert pre(row)["model"] is None, name  # the engine runs it on the base model
    adapter = {"url": "/v1/chat/completions", "model": "support-tone", "body": json.dumps({**body, "model": "support-tone"})}
    assert pre(adapter).get("model", "support-tone") == "support-tone"  # an adapter's name stays the row's
