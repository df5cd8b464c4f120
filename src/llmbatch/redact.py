"""Secrets never reach disk or logs.

Job files and configs can carry secrets: HTTP headers (``Authorization``), ``runtime_env``
environment variables (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``), tokens in engine settings,
credentials and signed query strings in URLs. Everything llmbatch writes to a job directory
(``job.json``, ``log.txt``, ``stats.json``, ``errors.jsonl``) or prints goes through
:func:`redact` / :func:`redact_text` first.

A job file can name a secret instead of holding it: ``${HF_TOKEN}`` in a string value (outside
the prompt text: see :data:`llmbatch.jobs.document.AS_WRITTEN`) is read from the environment when
the job is loaded, and the job directory keeps the reference,
so ``llmbatch resume`` reads it again. A literal secret is written as :data:`REDACTED`; such a
job resumes from its job file (``llmbatch run job.yaml``), not from the job directory alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from llmbatch.errors import ConfigError, JobError

REDACTED = "<redacted>"
#: Words that make a key (header, env var, setting, query parameter) a secret.
SECRET_WORDS = frozenset("""
token secret secrets password passwd pwd credential credentials authorization auth cookie apikey
signature sig privatekey bearer
""".split())
#: Word pairs that do (``api_key``, ``AWS_SECRET_ACCESS_KEY``, ``x-amz-security-token``...).
SECRET_PAIRS = (("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("session", "token"),
                ("security", "token"), ("account", "key"), ("client", "secret"))
#: A key ending in "key" names a secret (``OPENAI_KEY``, ``Ocp-Apim-Subscription-Key``,
#: ``x-functions-key``) unless the word before says it is an index (``sort_key``...).
NOT_SECRET_KEYS = frozenset("sort cache partition primary foreign group dedup hash id lookup row column index public "
                            "prefix join order routing".split())
#: Dicts whose every value is a secret (``${VAR}`` references aside): HTTP headers and
#: environment variables, whatever they are called.
ALL_SECRET = frozenset({"headers", "extra_headers", "default_headers", "http_headers", "env_vars", "env",
                        "environment"})
#: Headers whose values are never secret (every other header's value is redacted).
PLAIN_HEADERS = frozenset({"content-type", "accept", "accept-encoding", "accept-language", "content-encoding",
                           "user-agent", "cache-control", "connection"})
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
_BEARER = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
#: Tokens by their look, wherever they stand in a text: OpenAI/Anthropic-style ``sk-...``,
#: Hugging Face ``hf_...``, AWS access key ids, GitHub, Slack and Google API keys, JWTs.
_TOKENS = re.compile(r"\b(?:sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{16,}|(?:AKIA|ASIA)[A-Z0-9]{16}"
                     r"|gh[pousr]_[A-Za-z0-9]{20,}|xox[abposr]-[A-Za-z0-9-]{10,}|AIza[A-Za-z0-9_-]{30,}"
                     r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})")
#: ``name=value`` / ``"name": "value"`` in a text, where the name is a secret's.
_ASSIGNED = re.compile(r"""(?P<name>[A-Za-z][A-Za-z0-9_.-]*)(?P<sep>["']?\s*[:=]\s*["']?)(?P<value>[^\s"',;&}]{6,})""")


class Secret:
    """A secret value that shows as :data:`REDACTED` wherever it is printed, logged or
    written (``str``, ``repr``, JSON); ``.value`` is the secret itself."""

    __slots__ = ("value",)

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return REDACTED

    __str__ = __repr__

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Secret) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


def reveal(value: Any) -> Any:
    """The value behind a :class:`Secret` (other values as they are)."""
    return value.value if isinstance(value, Secret) else value


def is_secret_key(key: Any) -> bool:
    """Whether a key's name says its value is a secret (``max_num_batched_tokens`` is not; nor is
    ``api_key_env``, which holds the name of the variable with the secret, not the secret)."""
    camel = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key))  # accessToken, clientSecret
    words = [w for w in re.split(r"[^a-z0-9]+", camel.lower()) if w]
    words = ["key" if w == "keys" else w for w in words]
    if words and words[-1] == "env":
        return False
    if any(w in SECRET_WORDS for w in words):
        return True
    if words and words[-1] == "key" and (len(words) == 1 or words[-2] not in NOT_SECRET_KEYS):
        return True
    return any(a in words and b in words for a, b in SECRET_PAIRS)


def _redact_url(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(is_secret_key(k) or k.lower().startswith("x-amz-") for k, _ in pairs):
            query = urlencode([(k, REDACTED if is_secret_key(k) or k.lower().startswith("x-amz-") else v)
                               for k, v in pairs], safe="<>")
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: Any) -> Any:
    """``text`` with URL credentials, signed query values, bearer tokens, values assigned to a
    secret's name (``api_key=...``, ``"clientSecret": "..."``) and anything that looks like a
    token (``sk-...``, ``hf_...``, ``AKIA...``, JWTs) replaced."""
    if not isinstance(text, str):
        return text
    text = _URL.sub(lambda m: _redact_url(m.group(0)), text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    text = _ASSIGNED.sub(lambda m: m.group(0) if m.group("name").lower() == "key" or m.group("value") == REDACTED
                         or not is_secret_key(m.group("name"))
                         else f"{m.group('name')}{m.group('sep')}{REDACTED}", text)
    return _TOKENS.sub(REDACTED, text)


def _is_reference(value: Any) -> bool:
    """A value that names its secret instead of holding it: ``${VAR}``, ``Bearer ${VAR}``."""
    if not isinstance(value, str) or not _ENV_REF.search(value):
        return False
    return _ENV_REF.sub("", value).strip().lower() in ("", "bearer", "basic", "token")


def _all_secret(value: dict[Any, Any], headers: bool) -> dict[Any, Any]:
    """Headers or environment variables: every value redacted but ``${VAR}`` references (and,
    for headers, those in :data:`PLAIN_HEADERS`)."""
    out = {}
    for k, v in value.items():
        if _is_reference(v) or (headers and isinstance(v, str) and str(k).lower() in PLAIN_HEADERS):
            out[k] = v
        else:
            out[k] = v if v in (None, "") else REDACTED
    return out


def redact(value: Any, key: Any = None) -> Any:
    """A copy of ``value`` (dicts, lists, strings) with every secret replaced by
    :data:`REDACTED`. ``${VAR}`` references are kept: they name a secret, they are not one."""
    if isinstance(value, Secret):
        return REDACTED
    if key is not None and is_secret_key(key) and value not in (None, "", {}, []):
        if _is_reference(value):
            return value
        if not isinstance(value, (dict, list)):
            return REDACTED
    if isinstance(value, dict):
        if str(key).lower() in ALL_SECRET:
            return _all_secret(value, headers="header" in str(key).lower())
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def expand_env(value: Any, where: str = "", keep: Collection[str] = ()) -> Any:
    """Replace ``${VAR}`` in string values with the environment's value (a missing variable
    is a config error that names it and where it is used); the values of keys named in ``keep``
    (at any depth) are taken as written."""
    if isinstance(value, dict):
        return {k: v if k in keep else expand_env(v, f"{where}.{k}" if where else str(k), keep)
                for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, f"{where}[{i}]", keep) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        def sub(m: re.Match) -> str:
            name = m.group(1)
            if name not in os.environ:
                raise ConfigError(f"{where or 'the job'} uses ${{{name}}}, which is not set in the environment; "
                                  f"export {name}=... and run again")
            return os.environ[name]

        return _ENV_REF.sub(sub, value)
    return value


def find_redacted(value: Any, where: str = "") -> list[str]:
    """Where :data:`REDACTED` stands in place of a value."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in find_redacted(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in find_redacted(v, f"{where}[{i}]")]
    return [where] if isinstance(value, str) and REDACTED in value else []


def check_no_redacted(spec_data: dict[str, Any], job_dir: Any) -> None:
    """A job directory's spec with secrets left out cannot run by itself: say how to resume."""
    missing = find_redacted(spec_data)
    if missing:
        raise JobError(
            f"job {job_dir} was started with secrets written into its job file ({', '.join(missing)}), which "
            "llmbatch does not store. Resume it with the job file: `llmbatch run JOB.yaml` (it continues this "
            "job directory), and next time reference secrets from the environment, e.g. ${HF_TOKEN}.")
