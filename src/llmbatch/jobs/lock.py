"""The job directory's lock file, and its other files opened without following symlinks.

One driver per job directory holds an exclusive ``flock`` on ``lock``. ``status`` and the
server ask whether a driver holds it with a shared lock taken for an instant; a driver that
finds the lock taken retries for :data:`LOCK_WAIT_S` before it says another driver runs, so
such a probe never fails a job that is starting.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from llmbatch.errors import JobError

#: How long a driver retries the lock that someone holds (``status`` probes it for an instant).
LOCK_WAIT_S = 2.0


def take_lock(fh) -> None:
    """The job's exclusive lock; BlockingIOError when another holds it for longer than a probe."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def open_no_follow(path: Path, flags: int, mode: str):
    """Open a file of the job directory without following a symlink put in its place (a link
    from ``log.txt`` or ``lock`` elsewhere would make the job write there)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise JobError(f"{path} is a symbolic link; a job directory's own files must not be (remove it)") from None
        raise
    return os.fdopen(fd, mode)


def lock_is_held(path: Path) -> bool:
    """Whether a driver holds the lock at ``path`` right now."""
    try:
        fh = open_no_follow(path, os.O_RDONLY, "r")
    except FileNotFoundError:
        return False
    with fh:  # a shared probe for an instant: a driver taking the lock meanwhile waits for it
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False
