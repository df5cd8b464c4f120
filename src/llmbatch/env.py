"""Settings read from environment variables as numbers: the value parsed, or a ConfigError that
names the variable, its value and an example (never a bad value silently taken for the default);
and a short folder for Unix sockets where the temp dir's path is too long for them."""

from __future__ import annotations

import logging
import os
from typing import Any

from llmbatch.errors import ConfigError

logger = logging.getLogger(__name__)

#: The longest path a Unix socket may have (``sockaddr_un.sun_path``, less its NUL).
SOCKET_PATH_MAX = 107
#: Folders with short paths, in the order :func:`socket_dir` tries them.
SHORT_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def env_number(name: str, default: Any, parse: Any, what: str, example: str) -> Any:
    """The environment variable ``name`` read by ``parse`` (which raises ValueError for a value
    that is not ``what``), else ``default``; a bad value fails naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {what}; set it to e.g. {example}, or unset it") from None


def socket_dir(folder: str, longest_name: int, whose: str) -> str | None:
    """A folder with a short path for ``whose`` Unix sockets, named up to ``longest_name`` bytes
    below their folder, where ``folder`` (their default, under the temp dir) is too long a path
    for them; None where ``folder`` will do (or no short folder is writable: the default's own
    error then says why). A deep TMPDIR (a scheduler's per-job scratch, a test's tmp_path) made
    Ray's start and every vLLM engine's fail: "AF_UNIX path length cannot exceed 107 bytes"."""
    if len(os.fsencode(folder)) + longest_name <= SOCKET_PATH_MAX:
        return None
    for short in SHORT_DIRS:
        if os.path.isdir(short) and os.access(short, os.W_OK | os.X_OK):
            logger.info("%s sockets go under %s: %s is too long a path for them", whose, short, folder)
            return short
    return None
