"""What every command shares: the Typer app, the error console, a table of facts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmbatch.errors import LLMBatchError
from llmbatch.redact import redact_text

# click's plain help: a switch reads `--force`, not `--force <bool>`, and the help fits 80 columns
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Run LLMs over whole datasets: resumable, exactly-once batch inference.")
models_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Built-in offline models.")
app.add_typer(models_app, name="models")
console = Console(stderr=True)

SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override any job field: --set model.concurrency=2 (repeatable).")]


def doc(config: type, field: str, note: str = "") -> str:
    """A flag's help: the documentation of the config field it sets (one text for both, as vLLM
    derives its CLI help from its config), and what the flag itself adds (``note``)."""
    return " ".join(filter(None, (config.field_docs()[field], note)))


def fail(exc: BaseException, code: int = 2) -> None:
    """Print the error in one line, never wrapped (secrets redacted), and exit with ``code``."""
    console.print(f"[bold red]error:[/bold red] {escape(redact_text(str(exc)))}", soft_wrap=True)
    raise typer.Exit(code)


Command = TypeVar("Command", bound=Callable[..., Any])


def errors_in_one_line(command: Command) -> Command:
    """A command whose llmbatch errors are printed by :func:`fail` (one line, exit code 2), not
    as a traceback; its signature (Typer's options) is the command's own."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except LLMBatchError as exc:
            fail(exc)

    return run  # type: ignore[return-value]


def facts(title: str) -> Table:
    """A two-column table of named facts (a bold name, its value)."""
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    return table
