"""Where a replica's engine chatter goes: a file in Ray's log folder, not the terminal."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile


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

    def take_loggers(self) -> None:
        """vLLM's own log records (its front-end in this process) go to the log too."""
        for handler in logging.getLogger("vllm").handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setStream(self.fh)
