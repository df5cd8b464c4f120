"""Job files: loading, overrides, validation before any work starts."""

from __future__ import annotations

import textwrap

import pytest

from llmbatch.errors import ConfigError, JobError
from llmbatch.jobs.identity import numerics_fields, result_fields
from llmbatch.jobs.kinds import job_for
from llmbatch.jobs.run import open_job, run_job
from llmbatch.jobs.spec import load_job, template_fields
from llmbatch.jobs.store import JobDir


def write_job(tmp_path, body: str):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(body))
    return path


BASE = """
input: {path: data.csv, id_column: Index}
model: {source: smollm2-135m-instruct, engine_kwargs: {max_model_len: 512}, concurrency: 1}
prompt:
  system: You classify companies.
  user: "Which industry is {Company} in?"
  choices: [Retail, Finance, Other]
sampling_params: {temperature: 0, max_tokens: 8}
output: {path: out/result.parquet}
"""


@pytest.fixture
def job_file(tmp_path):
    (tmp_path / "data.csv").write_text("Index,Company,City\n1,Acme,Paris\n2,Globex,Rome\n3,Initech,Oslo\n")
    return write_job(tmp_path, BASE)


def test_load_resolves_paths_relative_to_the_job_file(job_file, tmp_path):
    spec = load_job(job_file)
    assert spec.input.path == str(tmp_path / "data.csv")
    assert spec.output.path == str(tmp_path / "out" / "result.parquet")
    assert spec.resolved_job_dir() == str(tmp_path / "out" / "result.parquet.job")
    assert spec.processor_config().engine_kwargs == {"max_model_len": 512}


def test_set_overrides_any_field(job_file):
    spec = load_job(job_file, overrides=["model.concurrency=2", "sampling_params.max_tokens=4",
                                         "prompt.choices=[A, B]", "input.limit=2"])
    assert spec.processor_config().concurrency == 2
    assert spec.sampling_params["max_tokens"] == 4
    assert spec.prompt.choices == ["A", "B"]
    assert spec.input.limit == 2


def test_typos_fail_with_the_field_named(job_file):
    with pytest.raises(ConfigError, match="'batch_sise'.*'batch_size'"):
        # a typo inside the model section (a processor config field)
        load_job(job_file, overrides=["model.batch_sise=8"])
    with pytest.raises(ConfigError, match="unknown sampling param 'max_token'; did you mean 'max_tokens'"):
        load_job(job_file, overrides=["sampling_params.max_token=8"])
    with pytest.raises(ConfigError, match="temperature=-1"):
        load_job(job_file, overrides=["sampling_params.temperature=-1"])
    with pytest.raises(ConfigError, match="'outptu'"):
        load_job(job_file, overrides=["outptu.path=x"])
    with pytest.raises(ConfigError, match="concurrency"):
        load_job(job_file, overrides=["model.concurrency=0"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_job(job_file, overrides=["model.source=./nowhere"])


def test_template_fields():
    assert template_fields("Hi {First Name} at {Company}! {{literal}}") == ["First Name", "Company"]
    with pytest.raises(ValueError):
        template_fields("positional {}")


def test_missing_template_fields_fail_before_inference(job_file):
    spec = load_job(job_file, overrides=["prompt.user=Where is {Company} in {Region}? ({Cityy})"])
    with pytest.raises(ConfigError) as err:
        run_job(spec, quiet=True)
    text = str(err.value)
    assert "{Region}" in text and "{Cityy}" in text and "Index, Company, City" in text


def test_duplicate_ids_fail_before_inference(tmp_path):
    (tmp_path / "data.csv").write_text("Index,Company\n1,A\n2,B\n1,C\n3,D\n3,E\n")
    spec = load_job(write_job(tmp_path, BASE))
    with pytest.raises(JobError) as err:
        run_job(spec, quiet=True)
    assert "duplicate" in str(err.value) and "'1' (2 rows)" in str(err.value) and "'3' (2 rows)" in str(err.value)


def test_changed_config_or_input_is_refused(job_file, tmp_path):
    from llmbatch.jobs.run import read_input

    spec = load_job(job_file)
    job = JobDir(spec.resolved_job_dir())
    opened = job_for(spec)
    open_job(opened)
    read_input(opened)
    # placement changes resume silently
    open_job(job_for(load_job(job_file, overrides=["model.accelerator_type=L4", "model.stall_timeout_s=60"])))
    assert not job.meta().config_history
    # batching/parallelism changes resume, with a warning recorded in job.json
    open_job(job_for(load_job(job_file, overrides=["model.concurrency=3", "model.batch_size=7",
                                                "model.engine_kwargs.max_num_seqs=8"])))
    history = job.meta().config_history
    assert history[-1]["kind"] == "numerics"
    assert any("max_num_seqs" in c for c in history[-1]["changes"]) and "near-ties" in job.log_path.read_text()
    with pytest.raises(JobError) as err:
        open_job(job_for(load_job(job_file, overrides=["sampling_params.temperature=0.7"])))
    assert "sampling_params.temperature: 0 -> 0.7" in str(err.value) and "--force" in str(err.value)
    with pytest.raises(JobError, match="engine_kwargs.max_model_len"):
        open_job(job_for(load_job(job_file, overrides=["model.engine_kwargs.max_model_len=1024"])))
    (tmp_path / "data.csv").write_text("Index,Company,City\n1,Acme,Paris\n2,Globex,Rome\n3,Initech,Bergen\n")
    with pytest.raises(JobError, match="changed since the job started"):
        open_job(job_for(spec))
    # --force starts over
    meta2 = open_job(job_for(spec), force=True)
    assert not meta2.ingested


def test_result_fields_ignore_performance_settings(job_file):
    a = result_fields(load_job(job_file))
    b = result_fields(load_job(job_file, overrides=["model.batch_size=128", "model.engine_kwargs.max_num_seqs=8"]))
    assert a == b
    assert numerics_fields(load_job(job_file)) != numerics_fields(
        load_job(job_file, overrides=["model.engine_kwargs.max_num_seqs=8"]))


HTTP_MODEL = """
model:
  processor: http
  source: gpt-4o-mini
  url: https://api.example.com/v1/chat/completions
  api_key_env: LLMBATCH_TEST_KEY
  headers: {OpenAI-Organization: org-1, X-Secret-Token: "${LLMBATCH_TEST_TOKEN}"}
  qps: 5
  tokens_per_minute: 100000
"""


def test_the_same_job_runs_against_an_endpoint_by_changing_the_model_section(job_file, tmp_path, monkeypatch):
    import json

    from llmbatch.jobs.spec import redacted_spec

    monkeypatch.setenv("LLMBATCH_TEST_KEY", "sk-from-env-0123456789")
    monkeypatch.setenv("LLMBATCH_TEST_TOKEN", "tok-0123456789abcdef")
    text = job_file.read_text().replace(
        "model: {source: smollm2-135m-instruct, engine_kwargs: {max_model_len: 512}, concurrency: 1}", HTTP_MODEL)
    spec = load_job(write_job(tmp_path, text))
    config = spec.processor_config()
    assert config.model == "gpt-4o-mini" and config.qps == 5 and config.should_continue_on_error
    written = json.dumps(redacted_spec(spec))
    assert "sk-from-env" not in written and "tok-0123" not in written
    assert "${LLMBATCH_TEST_TOKEN}" in written and "LLMBATCH_TEST_KEY" in written  # names kept for resume
    fields = result_fields(spec)
    assert fields["model.url"] == "https://api.example.com/v1/chat/completions"
    assert not any(k.startswith(("model.headers", "model.qps", "model.api_key_env")) for k in fields)
    # limits and keys may change between runs; the endpoint and the model decide answers
    faster = load_job(write_job(tmp_path, text.replace("qps: 5", "qps: 50")))
    assert result_fields(faster) == fields
    monkeypatch.delenv("LLMBATCH_TEST_KEY")
    with pytest.raises(ConfigError, match="LLMBATCH_TEST_KEY"):
        load_job(write_job(tmp_path, text))


def test_a_job_imports_its_own_hooks_module_after_another_jobs_of_the_same_name(tmp_path):
    from llmbatch.jobs.spec import load_function

    for name, answer in (("one", "first"), ("two", "second")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "samename_hooks.py").write_text(f"def request(row):\n    return {answer!r}\n")
    first = load_function("samename_hooks:request", [str(tmp_path / "one")])
    second = load_function("samename_hooks:request", [str(tmp_path / "two")])
    assert (first({}), second({})) == ("first", "second")
    assert load_function("samename_hooks:request", [str(tmp_path / "two")])({}) == "second"


def test_run_job_takes_a_dict_of_a_job_files_sections(job_file, tmp_path, monkeypatch):
    """From Python, a job needs no file: ``run_job({...})`` is the job file's sections (relative
    paths from the working directory); it was a TypeError ("expected str, bytes or os.PathLike
    object, not dict"). Checked up to the preflight: a missing input is named before any work."""
    import yaml

    from llmbatch.jobs.run import resolve_spec

    monkeypatch.chdir(tmp_path)
    sections = yaml.safe_load(job_file.read_text())
    assert resolve_spec(sections, None) == load_job(job_file)
    with pytest.raises(ConfigError, match=r"--input .*nosuch.csv.* does not exist"):
        run_job({**sections, "input": {"path": "nosuch.csv"}}, quiet=True)
    with pytest.raises(ConfigError, match="a job is a JobSpec, a dict of a job file's sections, .* not list"):
        run_job([sections], quiet=True)
    assert not (tmp_path / "out").exists()
