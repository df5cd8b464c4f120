"""What reaches the terminal while a job runs: llmbatch's own view, not Ray's and vLLM's notices.

Ray and vLLM write lines meant for their own developers: Ray's C++ core worker warns about
actor arguments in the object store, its raylet reports the actors Ray Data kills on purpose
(``(raylet) ... killed by ray.kill``), Ray Data and vLLM log INFO and WARNING lines. While a job
runs, :func:`job_terminal` sends them to the job's ``log.txt``:

- in the Python API (``run_job``), the records of Ray's, vLLM's and their libraries' loggers
  below ERROR go to the log; errors still reach the terminal as well (nothing real is hidden);
- in the ``llmbatch`` process itself (:func:`claim_process`, called by the CLI's entry point),
  everything else written to the process's stdout and stderr as well (Python's and, on file
  descriptor 2, Ray's C++ logs), and Ray, if the job started it, stops before the terminal is
  given back (its last notices arrive as it stops). The job's own view (the live table, the
  summary) and its errors (raised, printed by the CLI) are what the terminal shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

#: Loggers whose records go to the job's log (with their children).
LIBRARIES = ("ray", "vllm", "transformers", "huggingface_hub", "torch", "filelock", "urllib3", "fsspec", "datasets")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

_own_process = False


def claim_process() -> None:
    """Say that this process is ``llmbatch``'s own (the CLI): a job may take its stdout and stderr."""
    global _own_process
    _own_process = True


@dataclass
class Terminal:
    """The terminal's streams for llmbatch's own view while a job runs (None: ``sys``'s)."""

    out: TextIO | None = None
    err: TextIO | None = None


def _terminal_handlers() -> list[tuple[logging.Logger, logging.StreamHandler]]:
    """The handlers of the libraries' loggers that write to the process's stdout or stderr."""
    std = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    found = []
    names = [n for n in list(logging.Logger.manager.loggerDict) if n.split(".")[0] in LIBRARIES]
    for name in names:
        logger = logging.getLogger(name)
        for handler in list(getattr(logger, "handlers", [])):
            if (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
                    and (id(handler.stream) in std or getattr(handler.stream, "fileno", None) and _is_std(handler.stream))):
                found.append((logger, handler))
    return found


def _is_std(stream: Any) -> bool:
    try:
        return stream.fileno() in (1, 2)
    except Exception:  # noqa: BLE001 - a stream without a file descriptor
        return False


class _BelowErrorOnce(logging.Filter):
    """Records below ERROR, each once (a record passes every logger up its chain, and the log's
    handler sits on several of them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or getattr(record, "_llmbatch_logged", False):
            return False
        record._llmbatch_logged = True
        return True


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def job_terminal(log_path: Path) -> Iterator[Terminal]:
    """Send Ray's and vLLM's lines to ``log_path`` while the block runs (see module docstring);
    yields the streams that llmbatch's own view writes to."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # never through a symlink put in log.txt's place (as the job directory's own writes)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    log = os.fdopen(fd, "a", buffering=1, encoding="utf-8", errors="replace")
    try:
        if _own_process:
            with _whole_process(log) as terminal:
                yield terminal
        else:
            with _library_records(log):
                yield Terminal()
    finally:
        log.close()


@contextlib.contextmanager
def _library_records(log: TextIO) -> Iterator[None]:
    """The Python API: the libraries' records below ERROR go to the log instead of the terminal."""
    to_file = logging.StreamHandler(log)
    to_file.setFormatter(logging.Formatter(LOG_FORMAT))
    to_file.addFilter(_BelowErrorOnce())
    taken = _terminal_handlers()
    errors_only = _ErrorsOnly()
    loggers = {id(lg): lg for lg, _ in taken}
    for _, handler in taken:
        handler.addFilter(errors_only)
    for lg in loggers.values():
        lg.addHandler(to_file)
    try:
        yield
    finally:
        for lg in loggers.values():
            lg.removeHandler(to_file)
        for _, handler in taken:
            handler.removeFilter(errors_only)


@contextlib.contextmanager
def _whole_process(log: TextIO) -> Iterator[Terminal]:
    """The CLI's process: whatever is written to stdout and stderr goes to the log, but for the
    job's own view, which writes to the terminal's streams kept aside."""
    import ray

    had_ray = ray.is_initialized()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved_fd = os.dup(2)
    terminal_err = open(os.dup(saved_fd), "w", buffering=1, encoding="utf-8", errors="replace")
    terminal = Terminal(out=sys.stdout, err=terminal_err)
    saved_streams = (sys.stdout, sys.stderr)
    handlers = _terminal_handlers()
    old = [(h, h.setStream(log)) for _, h in handlers]
    os.dup2(log.fileno(), 2)  # Ray's C++ logs (its core worker in this process)
    sys.stdout = sys.stderr = log  # Ray's messages for the driver, warnings, progress bars
    try:
        yield terminal
    finally:
        try:
            if not had_ray and ray.is_initialized():
                ray.shutdown()  # its last notices (actors it killed) arrive while it stops
        finally:
            log.flush()
            sys.stdout, sys.stderr = saved_streams
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            for handler, stream in old:
                handler.setStream(stream)
            terminal_err.close()
