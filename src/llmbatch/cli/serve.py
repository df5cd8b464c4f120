"""``llmbatch serve``: the OpenAI Batch API server (FastAPI & co. are the ``serve`` extra, imported
only when the command runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmbatch.cli.base import SetOpt, app, fail
from llmbatch.errors import LLMBatchError, MissingDependencyError


@app.command()
def serve(
    model: Annotated[str, typer.Option("--model", "-m", help="The model every batch runs: offline alias, folder, hub id, .gguf.")],
    data_dir: Annotated[Path, typer.Option(help="Database, files and batch jobs live here.")] = Path("llmbatch-data"),
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    set_: SetOpt = None,
    served_model_name: Annotated[Optional[list[str]], typer.Option(help="A name request bodies may use for the model (repeatable; the first is what answers carry).")] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(help="File with one API key per line (also: LLMBATCH_API_KEYS=key1,key2).")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="No API key needed (loopback addresses only).")] = False,
    database_url: Annotated[Optional[str], typer.Option(help="SQLAlchemy URL of the metadata database (default: sqlite in --data-dir).")] = None,
    files_url: Annotated[Optional[str], typer.Option(help="Where file contents live: a folder or fsspec URL (default: <data-dir>/files).")] = None,
    max_running: Annotated[int, typer.Option(help="Batches that run at once (the rest queue; 0: batches queue and none runs).")] = 1,
    max_file_bytes: Annotated[int, typer.Option(help="Largest upload, in bytes.")] = 200 * (1 << 20),
    max_lines: Annotated[int, typer.Option(help="Most requests in one batch file.")] = 50_000,
    invalid_lines: Annotated[str, typer.Option(help="'fail': a batch with invalid lines fails with their line numbers; 'error': they become error lines.")] = "fail",
    tenant_bytes: Annotated[int, typer.Option(help="Bytes of files one key's project may store (uploads and outputs); past it, 429.")] = 10 * (1 << 30),
    tenant_batches: Annotated[int, typer.Option(help="Unfinished batches one key's project may have; past it, 429.")] = 100,
    max_window_hours: Annotated[int, typer.Option(help="Longest completion_window accepted, in hours (the shortest is OpenAI's 24h).")] = 168,
    stop_grace: Annotated[float, typer.Option(help="Seconds a cancelled or expired batch's job has to stop after SIGTERM before its process group gets SIGKILL.")] = 30.0,
    ssl_certfile: Annotated[Optional[Path], typer.Option(help="TLS certificate (PEM): serve HTTPS.")] = None,
    ssl_keyfile: Annotated[Optional[Path], typer.Option(help="TLS private key (PEM), with --ssl-certfile.")] = None,
    log_level: Annotated[str, typer.Option(help="Server log level.")] = "info",
) -> None:
    """An OpenAI-compatible Batch API (/v1/files, /v1/batches) on your own GPUs: each batch is a
    resumable, exactly-once job on the Ray cluster RAY_ADDRESS names."""
    try:
        # FastAPI & co. only for `serve` (tests/test_architecture.py LAZY_IMPORTS)
        from llmbatch.server import main as server, settings as settings_mod
    except ImportError as exc:
        fail(MissingDependencyError(f"llmbatch serve ({exc.name} is missing)", "llmbatch[serve]"))
    try:
        settings = settings_mod.ServerSettings(
            data_dir=data_dir, model=model, host=host, port=port, overrides=set_ or [],
            served_model_name=served_model_name or [], api_keys=settings_mod.load_api_keys(api_key_file),
            no_auth=no_auth, database_url=database_url, files_url=files_url, max_running=max_running,
            max_file_bytes=max_file_bytes, max_lines=max_lines, invalid_lines=invalid_lines,
            tenant_bytes=tenant_bytes, tenant_batches=tenant_batches, max_window_s=max_window_hours * 3600,
            stop_grace_s=stop_grace, ssl_certfile=str(ssl_certfile) if ssl_certfile else None,
            ssl_keyfile=str(ssl_keyfile) if ssl_keyfile else None)
        server.serve(settings, log_level=log_level)
    except LLMBatchError as exc:
        fail(exc)
