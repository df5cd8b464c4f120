"""What ``llmbatch serve`` is started with, and the checks it makes before it listens.

API keys come from ``LLMBATCH_API_KEYS`` (comma-separated) or ``--api-key-file``: one key per
line, optionally followed by a project name (``KEY team-search``: keys of one project share its
files and batches); a line whose first character (after spaces) is ``#`` is a comment, and so is
what follows `` #`` after a key (a ``#`` inside a key is part of it). Keys shorter than
``MIN_KEY_CHARS`` are refused. Keys are kept in memory only: never logged, never written to the
database (a file or batch records its tenant: the project's name or a digest of the key), a job
file or a job's environment. Without a key the server refuses to start unless it is told
``--no-auth`` and listens on loopback only.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from llmbatch.errors import ConfigError

KEYS_ENV = "LLMBATCH_API_KEYS"
MiB = 1 << 20
GiB = 1 << 30
MIN_KEY_CHARS = 20
LOCAL_TENANT = "local"                 # everything a --no-auth server stores
PROJECT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass
class ServerSettings:
    """Everything the server needs; the CLI fills it from flags and the environment."""

    data_dir: Path
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    overrides: list[str] = field(default_factory=list)   # --set: job fields every batch gets
    served_model_name: list[str] = field(default_factory=list)
    api_keys: Mapping[str, str] | frozenset[str] = frozenset()  # key -> tenant (a bare set: one tenant per key)
    no_auth: bool = False
    database_url: str | None = None                       # default: sqlite in data_dir
    files_url: str | None = None                          # default: data_dir/files (any fsspec URL)
    max_running: int = 1                                  # batches running at once (0: they queue, none runs)
    max_file_bytes: int = 200 * MiB                       # as OpenAI's limit for batch input files
    max_lines: int = 50_000                               # requests per batch file, as OpenAI's
    max_json_bytes: int = MiB                             # any other request body
    tenant_bytes: int = 10 * GiB                          # files a tenant stores (uploads and outputs)
    tenant_batches: int = 100                             # a tenant's unfinished batches
    max_window_s: int = 7 * 86400                         # longest completion_window (shortest: 24h, as OpenAI)
    stop_grace_s: float = 30.0                            # SIGTERM -> SIGKILL of a stopped job's process group
    invalid_lines: str = "fail"                           # "fail": a batch with bad lines fails; "error": error lines
    max_attempts: int = 3                                 # job process runs per batch before it fails
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    poll_s: float = 0.5
    sweep_s: float = 60.0                                 # how often expired files are deleted
    lease_s: float = 60.0                                 # the database lease a live server renews (one per database)

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'llmbatch.db').resolve()}"

    @property
    def files_root(self) -> str:
        return self.files_url or str((self.data_dir / "files").resolve())

    @property
    def batches_dir(self) -> Path:
        return self.data_dir / "batches"

    def keyring(self) -> dict[str, str]:
        """Key -> tenant."""
        if isinstance(self.api_keys, Mapping):
            return dict(self.api_keys)
        return {key: key_tenant(key) for key in self.api_keys}


def key_tenant(key: str) -> str:
    """The tenant of a key with no project: a digest (the key itself is never stored)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _short(where: str) -> ConfigError:
    return ConfigError(f"{where}: an API key has fewer than {MIN_KEY_CHARS} characters; use long random keys "
                       "(python -c 'import secrets; print(\"sk-\" + secrets.token_urlsafe(32))')")


def parse_key_line(line: str, where: str) -> tuple[str, str] | None:
    """(key, tenant) of one key file line, or None for a blank line or a comment."""
    fields = line.split()
    if not fields or fields[0].startswith("#"):
        return None
    comment = next((i for i, f in enumerate(fields) if i and f.startswith("#")), len(fields))
    fields = fields[:comment]
    if len(fields) > 2:
        raise ConfigError(f"{where}: expected 'KEY' or 'KEY PROJECT' (a project name has no spaces)")
    key = fields[0]
    if len(key) < MIN_KEY_CHARS:
        raise _short(where)
    if len(fields) == 2:
        if not PROJECT.match(fields[1]):
            raise ConfigError(f"{where}: a project name is letters, digits, '.', '_' or '-' (at most 64)")
        return key, "project-" + fields[1]
    return key, key_tenant(key)


def load_api_keys(key_file: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The keys from ``LLMBATCH_API_KEYS`` and ``key_file``, each with its tenant."""
    environ = os.environ if environ is None else environ
    keys: dict[str, str] = {}
    for key in (k.strip() for k in environ.get(KEYS_ENV, "").split(",")):
        if key:
            if len(key) < MIN_KEY_CHARS:
                raise _short(KEYS_ENV)
            keys[key] = key_tenant(key)
    if key_file is not None:
        path = Path(key_file)
        if not path.is_file():
            raise ConfigError(f"--api-key-file {str(path)!r} does not exist")
        for number, line in enumerate(path.read_text().splitlines(), 1):
            parsed = parse_key_line(line, f"--api-key-file {path.name} line {number}")
            if parsed is not None:
                keys[parsed[0]] = parsed[1]
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
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
    if settings.max_running < 0 or settings.max_lines < 1 or settings.max_file_bytes < 1:
        raise ConfigError("--max-lines and --max-file-bytes must be at least 1 and --max-running at least 0")
    if settings.tenant_bytes < 1 or settings.tenant_batches < 1:
        raise ConfigError("--tenant-bytes and --tenant-batches must be at least 1")
    if settings.invalid_lines not in ("fail", "error"):
        raise ConfigError("--invalid-lines must be fail or error")
    if bool(settings.ssl_certfile) != bool(settings.ssl_keyfile):
        raise ConfigError("--ssl-certfile and --ssl-keyfile go together")
    for name in ("ssl_certfile", "ssl_keyfile"):
        value = getattr(settings, name)
        if value and not Path(value).is_file():
            raise ConfigError(f"--{name.replace('_', '-')} {value!r} does not exist")
