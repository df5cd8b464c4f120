"""`llmbatch ARGS` run inside the test process, for tests of what a job does, not of its process.

A CLI process costs a Python start, llmbatch's imports and joining Ray again (5-8 s of CPU on
this machine, dozens of times in the suite); here the CLI's own entry point (typer's ``app``)
runs in the test process, which has joined the worker's Ray cluster already (the
``ray_cluster`` fixture), with what it prints captured. Tests of the process itself (a signal,
a kill, the phases counted from the process's start, what reaches the terminal) start one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import traceback

from typer.testing import CliRunner


def llmbatch(*args: str, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None
             ) -> subprocess.CompletedProcess:
    """The CLI's exit code and what it printed, as ``subprocess.run(..., capture_output=True,
    text=True)`` gives them; ``env``: variables set for the call (and restored after)."""
    from llmbatch.cli import app

    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.chdir(cwd) if cwd else contextlib.nullcontext():
            result = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))  # what a process would have printed
    return subprocess.CompletedProcess(["llmbatch", *map(str, args)], result.exit_code, result.stdout, stderr)
