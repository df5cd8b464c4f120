"""The process one batch's job runs in: ``python -m llmbatch.server.jobproc JOB.yaml PARENT_PID``.

It dies with the server (on Linux the kernel sends it SIGTERM when its parent dies, which
stops the job cleanly: answered rows are committed, ``resume`` goes on from them). Exit codes
as ``llmbatch run``: 0 finished, 130 stopped, 2 a config or input mistake, 1 anything else.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from llmbatch.errors import LLMBatchError
from llmbatch.jobs.run import run_job

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux); exit if it is already gone."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the server's restart waits for the job's lock
        return
    if os.getppid() != parent:
        sys.exit(130)


def main(argv: list[str]) -> int:
    if len(argv) >= 3:
        die_with_parent(int(argv[2]))
    try:
        result = run_job(argv[1], quiet=True)
    except LLMBatchError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0 if result.ok else 130


if __name__ == "__main__":
    sys.exit(main(sys.argv))
