"""The ``llmbatch`` command line: jobs without Python.

``run`` (a job file or flags), ``resume``, ``status``, ``retry-errors``, ``verify``, ``plan``
(``cli/jobs.py``), ``models``, ``sample``, ``demo`` (``cli/getting_started.py``) and ``serve`` (the
OpenAI Batch API server: ``cli/serve.py``). Exit codes: 0 done (a job with error rows is done: see its
errors.jsonl), 2 a config or input mistake, 130 stopped by Ctrl-C (resume continues), 1 other.
"""

from __future__ import annotations

import sys
from typing import Any

from llmbatch import startlog, terminal
from llmbatch.engines import vllm_early

__all__ = ["app", "main"]


def _app() -> Any:
    # each registers its commands, in the order --help lists them
    from llmbatch.cli import jobs  # noqa: F401, I001
    from llmbatch.cli import getting_started  # noqa: F401
    from llmbatch.cli import serve  # noqa: F401
    from llmbatch.cli.base import app

    return app


def __getattr__(name: str) -> Any:
    if name == "app":  # (typer's app, with every command registered)
        return _app()
    raise AttributeError(f"module 'llmbatch.cli' has no attribute {name!r}")


def main() -> None:
    # this process is llmbatch's own: a job sends Ray's and vLLM's lines to its log.txt (llmbatch.terminal)
    terminal.claim_process()
    # the whole CLI process, from its start (the start-up ledger: LLMBATCH_START_LOG)
    with startlog.timed("cli", command=" ".join(sys.argv[1:2])):
        vllm_early.prewarm(sys.argv[1:])  # vLLM's import for a job's engine, beside the commands' imports
        app = _app()
        try:
            app()
        except KeyboardInterrupt:
            sys.exit(130)
        finally:
            vllm_early.stop_all()  # (a launcher the command did not use)


if __name__ == "__main__":
    main()
