"""What a newcomer reads: --help shows switches as switches and documents every option, `models
list` fits 80 columns without cutting the names to type, `plan` is a table of labelled lines,
`models make-test-models` works without peft and prints no load reports."""

from __future__ import annotations

import sys

import typer.main
from typer.testing import CliRunner

from llmbatch.cli import app
from llmbatch.models import list_models, resolve_model


def _commands() -> list:
    found = []

    def walk(cmd, path: list[str]) -> None:
        if hasattr(cmd, "commands"):  # a group (typer brings its own click)
            for name, sub in cmd.commands.items():
                walk(sub, path + [name])
        else:
            found.append((path, cmd))

    walk(typer.main.get_command(app), [])
    return found


def test_switches_read_as_switches_and_every_option_is_documented():
    commands = _commands()
    assert len(commands) >= 10
    undocumented = [f"{' '.join(path)} {p.opts}" for path, cmd in commands for p in cmd.params if not getattr(p, "help", None)]
    assert not undocumented, undocumented
    runner = CliRunner()
    for path, switch in ((["run"], "--quiet"), (["resume"], "--report"), (["retry-errors"], "--quiet"),
                         (["status"], "--json")):
        out = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "100"}).stdout
        assert "<bool>" not in out and switch in out, out
    run_help = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "100"}).stdout
    line = next(ln for ln in run_help.splitlines() if "--force" in ln)
    assert "Start over" in line and "<" not in line.split("Start over")[0], line


def test_a_flag_that_sets_a_config_field_shows_that_fields_documentation():
    """One text for both (vLLM derives its CLI help from its config): a field documented anew
    changes the flag's help with it."""
    from llmbatch.config import ProcessorConfig
    from llmbatch.jobs.spec import InputSpec, JobSpec, OutputSpec, PromptSpec

    run = next(cmd for path, cmd in _commands() if path == ["run"])
    helps = {p.opts[0]: p.help for p in run.params}
    for flag, config, field in (("--limit", InputSpec, "limit"), ("--id-column", InputSpec, "id_column"),
                                ("--invalid-lines", InputSpec, "invalid_lines"), ("--errors", OutputSpec, "errors_path"),
                                ("--system", PromptSpec, "system"), ("--task", JobSpec, "task"),
                                ("--job-dir", JobSpec, "job_dir"), ("--concurrency", ProcessorConfig, "concurrency")):
        assert helps[flag] == config.field_docs()[field], flag
    assert helps["--choices"].startswith(PromptSpec.field_docs()["choices"])


def test_models_list_fits_80_columns_and_never_cuts_a_name():
    out = CliRunner().invoke(app, ["models", "list"], env={"COLUMNS": "80"}).stdout
    assert max(len(ln) for ln in out.splitlines()) <= 80, out
    for model in list_models():
        assert model["name"] in out, (model["name"], out)
    assert "…" not in "".join(ln.split("│")[1] for ln in out.splitlines() if ln.count("│") > 2)


def test_plan_reads_as_labelled_lines():
    from llmbatch.jobs.plan import plan_lines

    plan = {"input": "in.csv", "model": "smollm2-135m-instruct", "task": "generate", "rows": 4, "rows_unreadable": 0,
            "rows_failing_preprocess": 0, "prompt_tokens": {"min": 51, "median": 54.0, "max": 60, "total": 216},
            "max_model_len": 512, "rows_over_max_model_len": 0, "rows_where_max_tokens_does_not_fit": 0,
            "duplicate_requests": 1, "unique_requests": 3, "shared_prefix_token_share": 0.5,
            "prompt_tokens_estimated": False, "max_output_tokens": 64, "max_tokens_per_row": 16,
            "estimate": {"method": "given throughput", "rows_per_s": 2.0, "seconds": 1.5},
            "plan_seconds": 0.4, "peak_memory_mib": 300.0}
    lines = dict(plan_lines(plan))
    assert not any("{" in v for v in lines.values()), lines
    assert lines["prompt tokens per row"] == "min 51, median 54, max 60"
    assert lines["max_tokens, per row"].startswith("16 ") and lines["output tokens, total"].startswith("64 ")
    assert lines["run time, estimated"].startswith("1.5 s at 2.0 rows/s")


def test_make_test_models_without_peft_skips_the_adapters_quietly(tmp_path, monkeypatch, capfd, minilm, smollm2):
    """After `make demo` (no dev extra: no peft) it builds the rest, says in one line that the
    LoRA adapters were skipped, and prints none of transformers' load reports; what it built in
    the cache is then named by alias."""
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    monkeypatch.setenv("LLMBATCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    # the offline models are prepared already: link them into this cache instead of preparing again
    (tmp_path / "cache" / "models").symlink_to(__import__("pathlib").Path(smollm2).parent)
    result = CliRunner().invoke(app, ["models", "make-test-models"])
    captured = capfd.readouterr()
    everything = result.stdout + result.stderr + captured.out + captured.err
    assert result.exit_code == 0, everything[-3000:]
    assert "LoRA adapters skipped" in everything and "peft" in everything
    assert "LOAD REPORT" not in everything and "smollm2-lora-a" not in everything
    assert resolve_model("tiny-vlm") == str(tmp_path / "cache" / "test-models" / "tiny-vlm")
