"""Templates are not shell strings: ``${VAR}`` is read from the environment where secrets and
paths go, never inside prompt text, so a ``$`` before a template field is a dollar sign."""

from __future__ import annotations

import textwrap

import pytest

from llmbatch.errors import ConfigError
from llmbatch.jobs.prompts import job_preprocess
from llmbatch.jobs.spec import load_job, redacted_spec

JOB = """
input: {path: "${LB_TEST_DATA_DIR}/data.csv"}
model: {source: smollm2-135m-instruct}
prompt:
  system: "Prices are in ${currency} where {currency} is set."
  user: "Product: {product} (${price})"
  regex: "\\\\$[0-9]+"
sampling_params: {max_tokens: 8, stop: ["${end}"]}
output: {path: out.parquet}
"""


@pytest.fixture
def job_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LB_TEST_DATA_DIR", str(tmp_path))
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(JOB))
    return path


def test_a_dollar_before_a_field_is_a_dollar_sign(job_file, monkeypatch):
    # variables named like the fields are set: they must not reach the prompt
    for name, value in {"price": "LEAKED", "currency": "LEAKED", "end": "LEAKED"}.items():
        monkeypatch.setenv(name, value)
    spec = load_job(job_file)
    assert spec.prompt.user == "Product: {product} (${price})"
    assert spec.prompt.fields() == ["currency", "product", "price"]
    request = job_preprocess(spec)({"product": "Lamp", "price": "19.90", "currency": "USD"})
    texts = [m["content"] for m in request["messages"]]
    assert texts == ["Prices are in $USD where USD is set.", "Product: Lamp ($19.90)"]
    assert request["sampling_params"]["stop"] == ["${end}"]
    assert "LEAKED" not in repr(spec.model_dump())


def test_unset_variables_in_prompt_text_are_not_an_error(job_file, monkeypatch):
    for name in ("price", "currency", "end"):
        monkeypatch.delenv(name, raising=False)
    spec = load_job(job_file)
    assert spec.prompt.system == "Prices are in ${currency} where {currency} is set."


def test_paths_and_secrets_are_still_read_from_the_environment(job_file, tmp_path, monkeypatch):
    spec = load_job(job_file)
    assert spec.input.path == str(tmp_path / "data.csv")
    assert redacted_spec(spec)["input"]["path"] == "${LB_TEST_DATA_DIR}/data.csv"  # kept for resume
    monkeypatch.delenv("LB_TEST_DATA_DIR")
    with pytest.raises(ConfigError, match="input.path uses \\$\\{LB_TEST_DATA_DIR\\}"):
        load_job(job_file)


def test_chat_templates_are_taken_as_written(tmp_path, monkeypatch):
    monkeypatch.setenv("role", "LEAKED")
    template = "{% for m in messages %}${role}: {{ m['content'] }}{% endfor %}"
    spec = load_job(data={"input": {"path": str(tmp_path / "d.csv")}, "output": {"path": str(tmp_path / "o.parquet")},
                          "model": {"source": "smollm2-135m-instruct",
                                    "chat_template_stage": {"chat_template": template}},
                          "prompt": {"user": "{a}"}})
    assert spec.processor_config().chat_template_stage.chat_template == template
