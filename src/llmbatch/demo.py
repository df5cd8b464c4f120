"""``llmbatch demo``: a real batch job on generated data with the default offline model.

Generates a customers CSV, asks the model which industry each company is in (answers
constrained to a fixed list), writes Parquet and prints where it is, the throughput, and a few
rows.
"""

from __future__ import annotations

import time
from pathlib import Path

from llmbatch.jobs.run import run_job
from llmbatch.jobs.spec import load_job
from llmbatch.models import DEFAULT_MODEL
from llmbatch.sample_data import INDUSTRIES, write_customers_csv

SYSTEM_PROMPT = "You classify companies by industry. Answer with the industry only."


def industry_request(row: dict) -> dict:
    """Preprocess for the demo: one chat request per customer row."""
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Which industry is the company '{row['Company']}' in?"},
        ],
        "sampling_params": {"temperature": 0, "max_tokens": 16, "structured_outputs": {"choice": INDUSTRIES}},
    }


def run_demo(rows: int = 2000, out_dir: str = "demo-output", model: str = DEFAULT_MODEL, seed: int = 0,
             concurrency: int = 1) -> dict:
    """Run the demo; returns the summary it prints."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    out = Path(out_dir)
    csv_path = write_customers_csv(out / "customers.csv", rows, seed)
    console.print(f"[bold]llmbatch demo[/bold]: {rows:,} customers in {csv_path}; model {model}")
    out = out.resolve()
    csv_path = csv_path.resolve()
    spec = load_job(data={
        "input": {"path": str(csv_path), "id_column": "Index"},
        "model": {"source": model, "engine_kwargs": {"max_model_len": 512}, "concurrency": concurrency,
                  "batch_size": 64},
        "prompt": {
            "system": SYSTEM_PROMPT,
            "user": "Which industry is the company '{Company}' in?",
            "choices": INDUSTRIES,
        },
        # room for the longest choice: constrained decoding may spell it in small tokens
        "sampling_params": {"temperature": 0, "max_tokens": 16},
        "output": {"path": str(out / "industries.parquet"), "columns": ["Index", "Company", "industry"],
                   "rename": {"generated_text": "industry"}},
        "job_dir": str(out / "job"),
    })
    start = time.perf_counter()
    result = run_job(spec, force=True)
    if not result.ok:
        raise SystemExit(130)
    wall = time.perf_counter() - start
    stats = result.stats
    table = Table(title="sample rows")
    import pyarrow.parquet as pq

    sample = pq.read_table(result.output_path).slice(0, 8).to_pylist()
    for col in ("Index", "Company", "industry"):
        table.add_column(col)
    for row in sample:
        table.add_row(str(row["Index"]), str(row["Company"]), str(row["industry"]))
    console.print(table)
    summary = {
        "output": str(result.output_path),
        "rows": stats["rows_ok"],
        "errors": stats["rows_error"],
        "wall_s": round(wall, 1),
        "rows_per_s": stats["rows_per_s"],
        "generated_tokens_per_s": stats["generated_tokens_per_s"],
        "delivered_tokens_per_s": stats["delivered_tokens_per_s"],
        "steady_generated_tokens_per_s": stats.get("steady_generated_tokens_per_s"),
        "deduplicated_rows": stats.get("deduplicated_rows", 0),
    }
    console.print(f"results: [bold]{summary['output']}[/bold] ({summary['rows']:,} rows, {summary['errors']} errors)")
    console.print(
        f"throughput: {summary['rows_per_s']:.1f} rows/s, {summary['generated_tokens_per_s']:.1f} tokens/s generated "
        f"by the engine, {summary['delivered_tokens_per_s']:.1f} tokens/s delivered (answers copied by dedup included) "
        f"over {summary['wall_s']} s including engine start; job directory {spec.job_dir}"
    )
    return summary
