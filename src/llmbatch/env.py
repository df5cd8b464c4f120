"""Settings read from environment variables as numbers: the value parsed, or a ConfigError that
names the variable, its value and an example (never a bad value silently taken for the default)."""

from __future__ import annotations

import os
from typing import Any

from llmbatch.errors import ConfigError


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
