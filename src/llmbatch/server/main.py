"""``llmbatch serve``: check the settings, take the data dir (one server per data dir: a second
is refused with a clear error, as two would run and fail each other's batches), open the
database and take its lease (one server per database too), open the file store, and listen
(with TLS when given ``--ssl-certfile``/``--ssl-keyfile``; a warning when keys would travel in
clear off loopback).

Needs the ``serve`` extra (FastAPI, uvicorn, SQLAlchemy, Alembic): the CLI imports this
module only for ``serve``, and says what to install when it cannot.
"""

from __future__ import annotations

import copy
import fcntl
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

import uvicorn

from llmbatch.errors import ConfigError
from llmbatch.jobs.openai_batch import served_names
from llmbatch.jobs.spec import apply_overrides, load_job
from llmbatch.openai.batch_file import Options
from llmbatch.openai.vocab import ENDPOINTS
from llmbatch.server.app import create_app
from llmbatch.server.db import Database
from llmbatch.server.runner import BatchRunner
from llmbatch.server.settings import ServerSettings, check, is_loopback
from llmbatch.server.storage import FileStore

logger = logging.getLogger("llmbatch.server")
LOCK_NAME = "server.lock"


def hold_data_dir(data_dir: Path) -> int:
    """Lock ``data_dir`` for this process (released when it exits); raises ConfigError naming the
    server that holds it. Returns the lock's file descriptor (keep it open)."""
    path = Path(data_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        os.close(fd)
        raise ConfigError(f"another llmbatch serve ({holder or 'pid unknown'}) uses the data dir {data_dir}; two "
                          "servers would run each other's batches: stop it, or give this one its own --data-dir "
                          "(and --database-url)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
    return fd


def job_template(settings: ServerSettings) -> dict[str, Any]:
    """The job fields every batch gets: the model (``--model``, ``--served-model-name``) and
    ``--set`` overrides (``model.engine_kwargs.max_model_len=4096``, ``commit_rows=500``...)."""
    doc: dict[str, Any] = {"model": {"source": settings.model}}
    if settings.served_model_name:
        doc["model"]["served_model_name"] = list(settings.served_model_name)
    doc = apply_overrides(doc, settings.overrides)
    for key in ("input", "output", "job_dir", "prompt", "preprocess", "postprocess"):
        if key in doc:
            raise ConfigError(f"--set {key}... is decided per batch by the server; set model, sampling_params, "
                              "commit_rows or commit_seconds")
    return doc


def probe(settings: ServerSettings, template: dict[str, Any]) -> tuple[list[str], Options]:
    """Check the batch job the server would run (model, overrides) before listening; returns
    the endpoints the model serves and what batch files are checked against."""
    doc = copy.deepcopy(template)
    probe_file = settings.data_dir / "probe.jsonl"
    doc.update(input={"path": str(probe_file), "format": "openai-batch"}, output={"path": str(probe_file) + ".out"})
    probe_file.touch()  # a job's input must exist when its file is read
    try:
        spec = load_job(data=doc)
    finally:
        probe_file.unlink(missing_ok=True)
    task = spec.processor_config().task_type
    endpoints = [url for url, kind in ENDPOINTS.items() if kind == task]
    if not endpoints:
        raise ConfigError(f"the model's task_type {task!r} serves no batch endpoint yet (scoring and rerank are not "
                          "supported yet); use a generate or embed model")
    return endpoints, Options(models=served_names(spec), task_type=task)


def serve(settings: ServerSettings, log_level: str = "info") -> None:
    """Run the server until Ctrl-C / SIGTERM (running batches stop and resume at the next start)."""
    check(settings)
    settings.data_dir = Path(settings.data_dir).resolve()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    lock = hold_data_dir(settings.data_dir)
    template = job_template(settings)
    endpoints, options = probe(settings, template)
    db = Database(settings.db_url)
    place = f"{os.uname().nodename}:{settings.data_dir} "  # a server killed here left it: take it over
    holder = f"{place}pid {os.getpid()} {secrets.token_hex(4)}"
    other = db.claim_lease(holder, settings.lease_s, time.time(), place=place)
    if other is not None:
        db.close()
        os.close(lock)
        raise ConfigError(f"another llmbatch serve ({other}) runs the batches of this database (--database-url); two "
                          "would run each other's batches: stop it, or give this server its own database")
    store = FileStore(settings.files_root)
    if settings.files_url is None:  # the data dir's own store: no other server writes there (the lock)
        store.remove_partial()
    runner = BatchRunner(settings, db, store, template, options)
    runner.lease = holder
    app = create_app(settings, db, store, runner, endpoints, options.models or [])
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("serving %s (%s) on %s:%s; data in %s; auth %s", options.models[0] if options.models else "?",
                ", ".join(endpoints), settings.host, settings.port, settings.data_dir,
                "off (loopback only)" if settings.no_auth else f"on ({len(settings.api_keys)} key(s))")
    if not settings.ssl_certfile and not is_loopback(settings.host):
        logger.warning("listening on %s without TLS: API keys and batch contents travel in clear; give "
                       "--ssl-certfile and --ssl-keyfile, or put a TLS proxy in front", settings.host)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level, access_log=True,
                    ssl_certfile=settings.ssl_certfile, ssl_keyfile=settings.ssl_keyfile)
    finally:
        db.release_lease(holder)
        db.close()
        os.close(lock)
