"""How batches move: validate, queue, run as jobs, stop, finish; and pick up after a restart.

One thread owns every transition after ``POST /v1/batches``:

- ``validating``: the input file is checked line by line (no engine); invalid -> ``failed``
  with line-numbered ``errors``, else ``in_progress`` (queued until a slot is free).
- ``in_progress``: up to ``max_running`` batches run at once, each an llmbatch job in a
  process of its own (``server.jobproc``) on the Ray cluster ``RAY_ADDRESS`` names;
  ``request_counts`` follow its committed parts. A job process that dies is started again
  (it resumes: exactly once) up to ``max_attempts`` times.
- ``finalizing`` -> ``completed``: the job's output and error files become files.
- ``cancelling`` -> ``cancelled`` and expiry -> ``expired``: the job's process group is stopped
  (SIGTERM: it commits what it answered; SIGKILL after ``stop_grace_s``), its output is written
  from the parts, the lines never run go to the error file as ``batch_cancelled`` /
  ``batch_expired`` (every line, for a batch stopped before its job read the input).
- Files past their ``expires_at`` are deleted (every ``sweep_s``), unless a running batch reads one.

While it runs, the server renews its lease on the database (``Database.claim_lease``); a
runner that lost it (a server that stalled past ``lease_s`` and was replaced) moves nothing.

Everything is state in the database and the job directories, so a restarted server (even
after SIGKILL) picks up where the last one was: running batches resume from their parts.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from llmbatch.jobs.openai_output import write_openai_output
from llmbatch.jobs.spec import load_job
from llmbatch.jobs.store import JobDir
from llmbatch.openai.batch_file import MAX_LISTED, Options, validate_batch_file
from llmbatch.redact import redact_text
from llmbatch.server.counts import LineCounter
from llmbatch.server.db import Database
from llmbatch.server.files import import_output
from llmbatch.server.settings import KEYS_ENV, ServerSettings
from llmbatch.server.stopping import stop_all, stop_step, write_not_run
from llmbatch.server.storage import FileStore

logger = logging.getLogger("llmbatch.server")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
STOP_MESSAGES = {"cancel": ("batch_cancelled", "The batch was cancelled before this request ran."),
                 "expire": ("batch_expired", "This request could not be executed before the completion window expired.")}


class BatchRunner:
    """The thread that moves batches (see module docstring)."""

    def __init__(self, settings: ServerSettings, db: Database, store: FileStore, job_template: dict[str, Any],
                 options: Options):
        self.settings = settings
        self.db = db
        self.store = store
        self.template = job_template
        self.options = options
        self.procs: dict[str, subprocess.Popen] = {}
        self.counters: dict[str, LineCounter] = {}
        self.validating: dict[str, Any] = {}
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="llmbatch-validate")
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.swept = 0.0
        self.lease: str | None = None   # the holder name this server took the database's lease as
        self.renewed = 0.0
        self.thread = threading.Thread(target=self._loop, name="llmbatch-runner", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.settings.batches_dir.mkdir(parents=True, exist_ok=True)
        self.thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the thread and the running jobs (they commit what they answered and resume at
        the next start)."""
        self.stopping.set()
        self.wake.set()
        self.thread.join(timeout=10)
        stop_all(list(self.procs.values()), timeout)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - one bad batch never stops the runner
                logger.exception("batch runner step failed")
            self.wake.wait(self.settings.poll_s)
            self.wake.clear()

    # -- one step ----------------------------------------------------------------------------

    def tick(self) -> None:
        if self.lease and time.monotonic() - self.renewed >= self.settings.lease_s / 3:
            other = self.db.claim_lease(self.lease, self.settings.lease_s, time.time())
            if other is not None:
                logger.error("the database's lease is held by %s: this server runs no batch until it has it back",
                             other)
                return
            self.renewed = time.monotonic()
        now = int(time.time())
        for batch in self.db.batches_in(ACTIVE):
            if batch["expires_at"] and now >= batch["expires_at"] and batch["status"] in ("validating", "in_progress") \
                    and not batch["stop"]:
                self.db.transition(batch["id"], ("validating", "in_progress"), stop="expire")
                batch["stop"] = "expire"
            handler = getattr(self, f"_{batch['status']}")
            handler(batch, now)
        if time.monotonic() - self.swept >= self.settings.sweep_s:
            self.swept = time.monotonic()
            self.sweep(now)

    def sweep(self, now: int) -> None:
        """Delete the files whose ``expires_at`` has passed (not one an unfinished batch reads)."""
        for file_id in self.db.expired_files(now):
            if self.db.file_in_use(file_id, ACTIVE):
                continue
            self.db.delete_file(file_id)
            self.store.delete(file_id)
            logger.info("file %s: expired, deleted", file_id)

    def batch_dir(self, batch_id: str) -> Path:
        return self.settings.batches_dir / batch_id

    def _validating(self, batch: dict[str, Any], now: int) -> None:
        if batch["stop"]:
            return self._finish_stopped(batch, now)
        bid = batch["id"]
        future = self.validating.get(bid)
        if future is None:
            options = Options(models=self.options.models, endpoint=batch["endpoint"], task_type=self.options.task_type)
            self.validating[bid] = self.pool.submit(validate_batch_file, self.store.location(batch["input_file_id"]),
                                                    options, self.settings.max_lines + 1)
            return
        if not future.done():
            return
        del self.validating[bid]
        try:
            report = future.result()
        except Exception as exc:  # noqa: BLE001 - an unreadable file fails its batch
            errors = [{"code": "invalid_file", "line": None, "message": f"the input file cannot be read: {exc}",
                       "param": None}]
            self.db.transition(bid, ("validating",), status="failed", failed_at=now, errors=errors)
            return
        errors = []
        if report.lines == 0:
            errors = [{"code": "empty_file", "line": None, "message": "the input file holds no requests", "param": None}]
        elif report.lines > self.settings.max_lines:
            errors = [{"code": "too_many_requests", "line": self.settings.max_lines + 1, "param": None,
                       "message": f"the file has more than {self.settings.max_lines:,} requests (--max-lines)"}]
        elif report.problems and self.settings.invalid_lines == "fail":
            errors = [p.as_error() for p in report.problems[:MAX_LISTED]]
            if len(report.problems) > MAX_LISTED:
                errors.append({"code": "more_errors", "line": None, "param": None,
                               "message": f"{len(report.problems) - MAX_LISTED} more invalid lines not listed"})
        if errors:
            self.db.transition(bid, ("validating",), status="failed", failed_at=now, errors=errors,
                               total=report.lines, failed=len(report.problems))
            return
        self.db.transition(bid, ("validating",), status="in_progress", in_progress_at=now, total=report.lines,
                           model=next(iter(report.models), None) or self.options.models[0])

    def _in_progress(self, batch: dict[str, Any], now: int) -> None:
        bid = batch["id"]
        job = JobDir(self.batch_dir(bid) / "job")
        proc = self.procs.get(bid)
        if proc is not None and proc.poll() is None:
            if batch["stop"]:
                stop_step(proc, self.settings.stop_grace_s)  # the job commits what it answered, then exits
            return self._count(batch)
        if proc is not None:
            self.procs.pop(bid)
            return self._exited(batch, proc.returncode, now)
        if job.exists() and job.is_running():  # a job process the last server left: wait for it
            return self._count(batch)
        if batch["stop"]:
            return self._finish_stopped(batch, now)
        if self._job_finished(job):
            return self._finish(batch, now)
        if len([p for p in self.procs.values() if p.poll() is None]) < self.settings.max_running:
            self._launch(batch)

    def _finalizing(self, batch: dict[str, Any], now: int) -> None:
        self._finish(batch, now)

    def _cancelling(self, batch: dict[str, Any], now: int) -> None:
        batch["stop"] = "cancel"
        proc = self.procs.get(batch["id"])
        if proc is not None or JobDir(self.batch_dir(batch["id"]) / "job").is_running():
            return self._in_progress(batch, now)
        self._finish_stopped(batch, now)

    # -- running a job -----------------------------------------------------------------------

    def _job_file(self, batch: dict[str, Any]) -> Path:
        folder = self.batch_dir(batch["id"])
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "job.yaml"
        if not path.exists():
            doc = {**self.template,
                   "input": {"path": self.store.location(batch["input_file_id"]), "format": "openai-batch",
                             "endpoint": batch["endpoint"], "invalid_lines": self.settings.invalid_lines},
                   "output": {"path": str(folder / "output.jsonl"), "errors_path": str(folder / "error.jsonl")},
                   "job_dir": str(folder / "job")}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
            os.replace(tmp, path)
        return path

    def _launch(self, batch: dict[str, Any]) -> None:
        bid = batch["id"]
        if batch["attempts"] >= self.settings.max_attempts:
            log = self._log_tail(bid)
            self.db.transition(bid, ("in_progress",), status="failed", failed_at=int(time.time()), errors=[
                {"code": "job_failed", "line": None, "param": None,
                 "message": f"the batch's job failed {batch['attempts']} times; last output: {log}"}])
            return
        if not self.db.transition(bid, ("in_progress",), unstopped=True, attempts=batch["attempts"] + 1):
            return  # cancelled (or expired) since this step read the batch: never started
        env = {k: v for k, v in os.environ.items() if k != KEYS_ENV}  # a job never sees the API keys
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable, "-m", "llmbatch.server.jobproc", str(self._job_file(batch)), str(os.getpid())]
        log = open(self.batch_dir(bid) / "driver.log", "ab")
        self.procs[bid] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=env, start_new_session=True)
        log.close()
        logger.info("batch %s: job started (attempt %d)", bid, batch["attempts"] + 1)

    def _count(self, batch: dict[str, Any]) -> None:
        counter = self.counters.setdefault(batch["id"], LineCounter(self.batch_dir(batch["id"]) / "job"))
        counts = counter.update()
        if counts is not None and counts != (batch["completed"], batch["failed"]):
            self.db.transition(batch["id"], None, completed=counts[0], failed=counts[1])

    def _exited(self, batch: dict[str, Any], code: int, now: int) -> None:
        bid = batch["id"]
        job = JobDir(self.batch_dir(bid) / "job")
        if batch["stop"]:
            return self._finish_stopped(batch, now)
        if code == 0 and self._job_finished(job):
            return self._finish(batch, now)
        if self.stopping.is_set():
            return
        logger.warning("batch %s: job exited with %s; %s", bid, code,
                       "failing the batch" if code == 2 else "running it again (it resumes)")
        if code == 2:  # a mistake no retry fixes (the model cannot load, the input is gone)
            self.db.transition(bid, ("in_progress",), status="failed", failed_at=now, errors=[
                {"code": "job_failed", "line": None, "param": None, "message": self._log_tail(bid)}])

    @staticmethod
    def _job_finished(job: JobDir) -> bool:
        if not job.exists():
            return False
        meta = job.meta()
        parts = job.part_files()
        upto = job.part_index(parts[-1]) if parts else -1
        return bool(meta.finished) and meta.finished.get("parts_upto") == upto and not meta.finalizing

    def _log_tail(self, bid: str, chars: int = 1500) -> str:
        """What a client is told of a failed job: its last ``error:`` line (the message of a
        mistake, redacted), never the log itself (it may name paths, hosts or secrets)."""
        path = self.batch_dir(bid) / "driver.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        lines = [line for line in text.splitlines() if line.startswith("error:")]
        if lines:
            return redact_text(lines[-1].strip())[:chars]
        return "the batch's job process failed; the server's operator finds its log in the data directory"

    # -- finishing ---------------------------------------------------------------------------

    def _finish(self, batch: dict[str, Any], now: int) -> None:
        bid = batch["id"]
        if batch["status"] != "finalizing":
            if not self.db.transition(bid, ("in_progress",), status="finalizing", finalizing_at=now):
                return
        folder = self.batch_dir(bid)
        self._import(batch, folder / "output.jsonl", folder / "error.jsonl")
        self.db.transition(bid, ("finalizing",), status="completed", completed_at=int(time.time()))
        self.counters.pop(bid, None)
        logger.info("batch %s: completed", bid)

    def _finish_stopped(self, batch: dict[str, Any], now: int) -> None:
        """A cancelled or expired batch: what was answered, and the rest as error lines."""
        bid = batch["id"]
        reason = "cancel" if batch["status"] == "cancelling" else batch["stop"]
        job = JobDir(self.batch_dir(bid) / "job")
        if job.exists() and job.meta().ingested:
            spec = load_job(self._job_file(batch))
            with job.locked():
                meta = job.meta()
                write_openai_output(job, spec, meta, job.state(meta.rows), missing=STOP_MESSAGES[reason])
                meta.finalizing = None
                job.write_meta(meta)
            self._import(batch, Path(spec.output.path), Path(spec.output.errors_path))
        else:  # stopped before the job read its input: every request is a not-run line
            folder = self.batch_dir(bid)
            folder.mkdir(parents=True, exist_ok=True)
            try:
                with self.store.open(batch["input_file_id"]) as source:
                    write_not_run(source, folder / "error.jsonl", bid, *STOP_MESSAGES[reason])
            except FileNotFoundError:
                logger.warning("batch %s: its input file is gone; no error file", bid)
            self._import(batch, folder / "output.jsonl", folder / "error.jsonl")
        final = {"cancel": ("cancelled", "cancelled_at"), "expire": ("expired", "expired_at")}[reason]
        self.db.transition(bid, ACTIVE, status=final[0], **{final[1]: int(time.time())})
        self.counters.pop(bid, None)
        logger.info("batch %s: %s", bid, final[0])

    def _import(self, batch: dict[str, Any], output: Path, errors: Path) -> None:
        fields = import_output(self.db, self.store, batch, output, errors)
        stats_path = self.batch_dir(batch["id"]) / "job" / "stats.json"
        if stats_path.exists():
            import json

            stats = json.loads(stats_path.read_text())
            cached = stats.get("cached_prompt_tokens") or 0
            fields["usage"] = {"input_tokens": stats.get("input_tokens", 0),
                               "input_tokens_details": {"cached_tokens": cached},
                               "output_tokens": stats.get("delivered_tokens", 0),
                               "output_tokens_details": {"reasoning_tokens": 0},
                               "total_tokens": stats.get("input_tokens", 0) + stats.get("delivered_tokens", 0)}
        self.db.transition(batch["id"], None, **fields)
