"""What ``llmbatch serve`` is started with, and the checks it makes before it listens.

API keys come from ``LLMBATCH_API_KEYS`` (comma-separated) or ``--api-key-file`` (one per
line, ``#`` comments); they are kept in memory only: never logged, never written to the
database, a job file or a job's environment. Without a key the server refuses to start unless
it is told ``--no-auth`` and listens on loopback only.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmbatch.errors import ConfigError

KEYS_ENV = "LLMBATCH_API_KEYS"
MiB = 1 << 20


@dataclass
class ServerSettings:
    """Everything the server needs; the CLI fills it from flags and the environment."""

    data_dir: Path
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    overrides: list[str] = field(default_factory=list)   # --set: job fields every batch gets
    served_model_name: list[str] = field(default_factory=list)
    api_keys: frozenset[str] = frozenset()
    no_auth: bool = False
    database_url: str | None = None                       # default: sqlite in data_dir
    files_url: str | None = None                          # default: data_dir/files (any fsspec URL)
    max_running: int = 1                                  # batches running at once
    max_file_bytes: int = 200 * MiB                       # as OpenAI's limit for batch input files
    max_lines: int = 50_000                               # requests per batch file, as OpenAI's
    invalid_lines: str = "fail"                           # "fail": a batch with bad lines fails; "error": error lines
    max_attempts: int = 3                                 # job process runs per batch before it fails
    poll_s: float = 0.5

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'llmbatch.db').resolve()}"

    @property
    def files_root(self) -> str:
        return self.files_url or str((self.data_dir / "files").resolve())

    @property
    def batches_dir(self) -> Path:
        return self.data_dir / "batches"


def load_api_keys(key_file: str | os.PathLike | None = None, environ: dict[str, str] | None = None) -> frozenset[str]:
    """The keys from ``LLMBATCH_API_KEYS`` and ``key_file``."""
    environ = os.environ if environ is None else environ
    keys = {k.strip() for k in environ.get(KEYS_ENV, "").split(",") if k.strip()}
    if key_file is not None:
        path = Path(key_file)
        if not path.is_file():
            raise ConfigError(f"--api-key-file {str(path)!r} does not exist")
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.add(line)
    return frozenset(keys)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check(settings: ServerSettings) -> None:
    """Refuse settings that would expose the server or cannot work (raises ConfigError)."""
    if settings.no_auth and settings.api_keys:
        raise ConfigError("--no-auth was given but API keys are configured; drop one of them")
    if not settings.api_keys and not settings.no_auth:
        raise ConfigError(f"no API key: set {KEYS_ENV}=key1,key2 or --api-key-file FILE (or, on loopback only, "
                          "--no-auth)")
    if settings.no_auth and not is_loopback(settings.host):
        raise ConfigError(f"--no-auth listens on loopback only (127.0.0.1, ::1, localhost), not {settings.host!r}; "
                          f"give API keys to listen on other addresses")
    if settings.max_running < 1 or settings.max_lines < 1 or settings.max_file_bytes < 1:
        raise ConfigError("--max-running, --max-lines and --max-file-bytes must be at least 1")
    if settings.invalid_lines not in ("fail", "error"):
        raise ConfigError("--invalid-lines must be fail or error")
