"""Where a replica's engine chatter goes: a file in Ray's log folder, not the terminal."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile

#: a traceback's last line, the exception's type and message (the engine process writes its lines
#: as "(EngineCore pid=N) ERROR 11-29 11:42:29 [core.py:1510] ValueError: ...", and again bare)
_EXCEPTION_LINE = re.compile(r"(?:^|\] )([A-Za-z_][\w.]*(?:Error|Exception)): (\S.*)$")
#: how far back from the log's end a start's reason is looked for
_REASON_BYTES = 1 << 20


class EngineLog:
    """Where a replica's engine chatter goes: a file in Ray's log folder, not the terminal.

    vLLM's start-up output (its processes' stdout/stderr, progress bars, warnings) and its own
    loggers write here; what the user must see comes back as llmbatch's errors and messages,
    which name this file.
    """

    def __init__(self):
        folder = None
        try:
            import ray

            folder = ray._private.worker._global_node.get_logs_dir_path()
        except Exception:  # noqa: BLE001 - not in a Ray worker
            pass
        folder = folder or tempfile.gettempdir()
        self.path = os.path.join(folder, f"llmbatch-engine-{os.getpid()}.log")
        self.fh = open(self.path, "a", buffering=1)

    @contextlib.contextmanager
    def capture(self):
        """Send this process's stdout/stderr (and so the engine processes it starts, which
        inherit them) to the log while the block runs."""
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(self.fh.fileno(), 1)
            os.dup2(self.fh.fileno(), 2)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)

    def mark(self) -> int:
        """Where the log ends now: :meth:`reason_since` reads what is written after it."""
        self.fh.flush()
        return os.path.getsize(self.path)

    def reason_since(self, mark: int) -> str | None:
        """The last exception the engine's processes wrote here since ``mark``: vLLM's front-end
        says only "Engine core initialization failed. See root cause above." when its engine
        process fails to start, and the cause is in this log."""
        try:
            with open(self.path, "rb") as f:
                f.seek(max(mark, os.path.getsize(self.path) - _REASON_BYTES))
                text = f.read().decode(errors="replace")
        except OSError:
            return None
        for line in reversed(text.splitlines()):
            found = _EXCEPTION_LINE.search(line.strip())
            if found:
                return f"{found.group(1)}: {found.group(2).strip()}"[:500]
        return None

    def with_reason(self, said: str, mark: int) -> str:
        """``said`` (the front-end's error) after the engine process's own reason, where the log
        has one since ``mark`` that ``said`` does not already give."""
        reason = self.reason_since(mark)
        return f"{reason} (vLLM: {said})" if reason and reason not in said else said

    def take_loggers(self) -> None:
        """vLLM's own log records (its front-end in this process) go to the log too."""
        for handler in logging.getLogger("vllm").handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setStream(self.fh)
