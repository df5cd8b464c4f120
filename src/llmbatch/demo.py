"""``llmbatch demo``: a real batch job on generated data with the default offline model.

Generates a customers CSV, asks the model which industry each company is in (answers
constrained to a fixed list), writes Parquet and prints where it is, a few randomly chosen
rows, the accuracy on the rows whose company name reveals the industry, and the throughput.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from pathlib import Path

from llmbatch.jobs.run import run_job
from llmbatch.jobs.spec import load_job
from llmbatch.models import DEFAULT_MODEL
from llmbatch.progress import rates_text
from llmbatch.sample_data import INDUSTRIES, known_industry, write_customers_csv

# Few-shot examples, one per label, written as the chat turns they stand for: SmolLM2-135M
# copies the pattern and answers with a label, where an instruction alone or a list of the
# labels leaves its answers to the constraint's first token (bench/demo_prompt.py measures
# both). No example uses a word of sample_data.TRADES, so the accuracy is not a lookup of
# the answer key. Their order matters to a model this small; this one measured best.
FEW_SHOT = [
    ("Rosie's Pizzeria", "food and beverage"), ("Channel Nine Broadcasting", "media"),
    ("Parkside Properties", "real estate"), ("Smith and Jones", "other"), ("Solid Ground Builders", "construction"),
    ("Harmon & Lee Attorneys", "legal"), ("Seaside Resort", "hotels and hospitality"),
    ("First Harbor Savings", "financial services"), ("Swift Freight", "transportation"),
    ("Lakeview Clinic", "healthcare"), ("Sunpeak Solar", "energy"), ("Brightpath Academy", "education"),
    ("Clearview Advisors", "consulting"), ("Green Valley Orchards", "agriculture"),
    ("Ironworks Fabrication", "manufacturing"), ("Roadstar Car Dealers", "automotive"),
    ("Northgate Cloud Systems", "technology"), ("Maple Street Grocers", "retail"),
]
SYSTEM_PROMPT = "You classify companies by industry. Reply with the industry only.\n\n" + "\n\n".join(
    f"User: {company}\nAssistant: {industry}" for company, industry in FEW_SHOT)
USER_PROMPT = "{Company}"  # the user turn is the company name, as in the examples
# room for the longest choice spelled one character per token (constrained decoding may) and the end
MAX_TOKENS = max(len(label) for label in INDUSTRIES) + 2


def accuracy(rows: Iterable[dict]) -> tuple[int, int]:
    """``(right, scored)`` over rows with ``Company`` and ``industry``: the rows whose company
    name reveals its industry (:func:`llmbatch.sample_data.known_industry`) are scored."""
    right = scored = 0
    for row in rows:
        known = known_industry(str(row["Company"]))
        if known is not None:
            scored += 1
            right += row["industry"] == known
    return right, scored


def sample_rows(rows: list[dict], k: int, seed: int) -> list[dict]:
    """``k`` rows chosen at random (seeded), in ``Index`` order."""
    picked = random.Random(seed).sample(range(len(rows)), min(k, len(rows)))
    return sorted((rows[i] for i in picked), key=lambda r: int(r["Index"]))


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
            "user": USER_PROMPT,
            "choices": INDUSTRIES,
        },
        "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS},
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
    import pyarrow.parquet as pq

    answered = pq.read_table(result.output_path, columns=["Index", "Company", "industry"]).to_pylist()
    table = Table(title=f"8 rows chosen at random (seed {seed})",
                  caption="known: the industry the name reveals; -: none (a guess, not scored)")
    for col in ("Index", "Company", "industry", "known"):
        table.add_column(col)
    for row in sample_rows(answered, 8, seed):
        known = known_industry(str(row["Company"]))
        style = "" if known is None else "green" if row["industry"] == known else "red"
        table.add_row(str(row["Index"]), str(row["Company"]), f"[{style}]{row['industry']}[/]" if style
                      else str(row["industry"]), known or "-")
    console.print(table)
    right, scored = accuracy(answered)
    if scored:
        console.print(f"accuracy on {scored:,} rows whose company name reveals the industry: "
                      f"[bold]{100 * right / scored:.1f}%[/bold]")
    summary = {
        "output": str(result.output_path),
        "rows": stats["rows_ok"],
        "errors": stats["rows_error"],
        "wall_s": round(wall, 1),
        "rows_per_s": stats["rows_per_s"],
        "window": stats.get("window"),
        "window_s": stats.get("window_s"),
        "startup_s": stats.get("startup_s"),
        "generated_tokens_per_s": stats["generated_tokens_per_s"],
        "delivered_tokens_per_s": stats["delivered_tokens_per_s"],
        "steady_generated_tokens_per_s": stats.get("steady_generated_tokens_per_s"),
        "deduplicated_rows": stats.get("deduplicated_rows", 0),
        "accuracy": round(right / scored, 4) if scored else None,
        "accuracy_rows": scored,
    }
    console.print(f"results: [bold]{summary['output']}[/bold] ({summary['rows']:,} rows, {summary['errors']} errors)")
    # the job's own figures (stats.json): its live view ended on them and `llmbatch status` shows them
    console.print(f"throughput: {rates_text(stats)}; job directory {spec.job_dir}")
    return summary
