"""Getting started without a model hub: ``models`` (list, prepare, make-test-models), ``sample``
and ``demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from llmbatch.cli.base import app, console, fail, models_app
from llmbatch.demo import run_demo
from llmbatch.errors import LLMBatchError
from llmbatch.models import DEFAULT_MODEL, list_models, prepare
from llmbatch.sample_data import write_customers_csv
from llmbatch.toy_models import lora_available, make_test_models


@models_app.command("list")
def models_list() -> None:
    """The offline models and the test models, whether each is ready, and the name -m takes."""
    table = Table(title="offline models (-m NAME)")
    table.add_column("name", no_wrap=True, min_width=max(len(m["name"]) for m in list_models()))  # never cut
    table.add_column("task", no_wrap=True)
    table.add_column("ready", no_wrap=True)
    table.add_column("description", ratio=1)
    for m in list_models():
        table.add_row(m["name"], m["task"], m["prepared"], m["description"])
    out = Console()
    out.print(table)
    out.print("not ready: llmbatch models prepare NAME, or llmbatch models make-test-models")


@models_app.command("make-test-models")
def models_make_test_models(
    folder: Annotated[Optional[str], typer.Argument(help="Where to build them (default: the cache's test-models).")] = None,
) -> None:
    """Build the seeded test models offline: a classifier, a cross-encoder, a reward model and
    LoRA adapters made from the offline models' weights, a tiny vision-language model and a tiny
    audio model (for trying every task without a hub)."""
    try:
        built = make_test_models(folder)
    except LLMBatchError as exc:
        fail(exc)
    for name, path in built.items():
        console.print(f"{name}: {path}", soft_wrap=True)
    if not lora_available():
        console.print("LoRA adapters skipped: they need peft (pip install peft, or the dev extra)", soft_wrap=True)
    if folder is None:
        console.print("use them by name: -m minilm-classifier, -m tiny-vlm, ... (llmbatch models list)", soft_wrap=True)


@models_app.command("prepare")
def models_prepare(name: Annotated[str, typer.Argument(help="Offline model name (see `models list`).")]) -> None:
    """Fetch and convert an offline model once (no model hub needed)."""
    try:
        path = prepare(name)
    except LLMBatchError as exc:
        fail(exc)
    console.print(f"{name}: ready at {path}")


@app.command()
def sample(
    output: Annotated[Path, typer.Argument(help="CSV file to write.")],
    rows: Annotated[int, typer.Option(help="Number of customers.")] = 1000,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same file).")] = 0,
) -> None:
    """Write a seeded customers CSV (Index, Customer Id, First Name, ..., Website)."""
    write_customers_csv(output, rows, seed)
    console.print(f"wrote {rows:,} customers to {output}")


@app.command()
def demo(
    rows: Annotated[int, typer.Option(help="Customers to classify.")] = 2000,
    out_dir: Annotated[str, typer.Option(help="Where to write the demo's files.")] = "demo-output",
    model: Annotated[Optional[str], typer.Option(help="Model (default: the offline SmolLM2).")] = None,
) -> None:
    """A real batch job on sample data: infer each customer's company industry."""
    try:
        run_demo(rows=rows, out_dir=out_dir, model=model or DEFAULT_MODEL)
    except LLMBatchError as exc:
        fail(exc)
