"""OpenAI Batch API files: one JSON line per request, read and checked line by line.

```
{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": ..., "messages": [...]}}
```

Each line is checked before any inference: JSON, a ``custom_id`` (a string, unique in the
file), ``method`` POST, a ``url`` llmbatch serves (the batch's endpoint, when one is given), a
body that endpoint accepts (:mod:`llmbatch.openai.requests`) and a ``model`` that names the
served model. :func:`validate_batch_file` lists every problem with its line number;
:func:`read_openai_batch` yields the rows a job runs, a bad line as a row whose read error
carries its OpenAI error code (``read: <code>: line N: ...``).

A request whose ``prompt`` (completions) or ``input`` (embeddings) is a list fans out into
one row per item (``sub`` of ``subs``); its output line is put back together from them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llmbatch.errors import ConfigError
from llmbatch.io.json_records import json_line
from llmbatch.io.readers import DEFAULT_BATCH_ROWS, Record, batched, open_input
from llmbatch.openai.requests import RequestError, prompts, translate
from llmbatch.openai.vocab import COMPLETIONS, ENDPOINTS, LATER_ENDPOINTS

FORMAT = "openai-batch"
#: Problems listed in full in a failed batch's ``errors`` (and the CLI's message); the rest counted.
MAX_LISTED = 100


@dataclass
class Problem:
    """One invalid line, as OpenAI's ``BatchError`` has it."""

    line: int
    code: str
    message: str
    param: str | None = None
    custom_id: str | None = None

    def as_error(self) -> dict[str, Any]:
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


@dataclass
class Options:
    """What a batch file is checked against."""

    models: list[str] | None = None      # names the body's ``model`` may use (None: any)
    endpoint: str | None = None          # every line's url must be this one (a server batch)
    task_type: str | None = None         # the served model's task: which endpoints it serves


@dataclass
class Report:
    """What :func:`validate_batch_file` found."""

    lines: int = 0                        # request lines (blank lines are not counted)
    rows: int = 0                         # rows the job runs (fanned-out prompts counted)
    problems: list[Problem] = field(default_factory=list)
    models: set[str] = field(default_factory=set)
    urls: set[str] = field(default_factory=set)

    def summary(self, limit: int = 20) -> str:
        shown = "\n".join(f"  line {p.line}: {p.code}: {p.message}" for p in self.problems[:limit])
        more = len(self.problems) - limit
        return shown + (f"\n  ... and {more} more" if more > 0 else "")


class BatchFileError(ConfigError):
    """A batch file with invalid lines; ``problems`` lists them with their line numbers."""

    def __init__(self, path: str, problems: list[Problem]):
        self.problems = problems
        report = Report(problems=problems)
        super().__init__(f"{path} has {len(problems)} invalid line(s); nothing was run:\n{report.summary()}\n"
                         "Fix them, or set input.invalid_lines: error (--invalid-lines error) to answer the valid "
                         "lines and write the invalid ones to the error file, as OpenAI does.")


def _check_line(lineno: int, raw: bytes, options: Options, seen: dict[str, int]) -> tuple[dict[str, Any], list[Any]]:
    """(the request, its prompts); raises :class:`RequestError` (``param`` is the field)."""
    try:
        value = json_line(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RequestError(f"the line is not UTF-8 ({exc.reason} at byte {exc.start})", None, "invalid_json") from None
    except ValueError as exc:
        raise RequestError(f"the line is not valid JSON ({exc})", None, "invalid_json") from None
    if not isinstance(value, dict):
        raise RequestError(f"the line is a JSON {type(value).__name__}, not an object", None, "invalid_json")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise RequestError("'custom_id' is missing or not a non-empty string", "custom_id", "missing_custom_id")
    extra = sorted(set(value) - {"custom_id", "method", "url", "body"})
    if extra:
        raise RequestError(f"unknown field(s) {extra}; a line has custom_id, method, url and body", extra[0],
                           "invalid_request")
    if custom_id in seen:
        raise RequestError(f"custom_id {custom_id!r} is also on line {seen[custom_id]}; custom_ids must be unique",
                           "custom_id", "duplicate_custom_id")
    seen[custom_id] = lineno
    if value.get("method") != "POST":
        raise RequestError(f"method must be POST, got {value.get('method')!r}", "method", "invalid_method")
    url = value.get("url")
    if url not in ENDPOINTS:
        later = " (scoring and rerank are not supported yet)" if url in LATER_ENDPOINTS else ""
        raise RequestError(f"url {url!r} is not supported{later}; use one of {', '.join(ENDPOINTS)}", "url",
                           "invalid_url")
    if options.endpoint and url != options.endpoint:
        raise RequestError(f"url {url!r} differs from the batch's endpoint {options.endpoint!r}", "url",
                           "invalid_url")
    if options.task_type and ENDPOINTS[url] != options.task_type:
        served = [u for u, t in ENDPOINTS.items() if t == options.task_type]
        raise RequestError(f"the model serves {', '.join(served)} (task_type {options.task_type}), not {url}",
                           "url", "invalid_url")
    body = value.get("body")
    if not isinstance(body, dict):
        raise RequestError("'body' must be a JSON object", "body", "invalid_body")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or (options.models and model not in options.models)):
        names = ", ".join(repr(m) for m in options.models or [])
        raise RequestError(f"model {model!r} is not the model this job serves ({names})", "body.model",
                           "model_not_found")
    items = prompts(url, body)
    for item in items:
        translate(url, body, item)
    return value, items


def iter_requests(path: str, options: Options) -> Iterator[tuple[int, dict[str, Any] | None, list[Any], Problem | None]]:
    """(line number, request, prompts, problem) for every non-blank line of ``path``."""
    seen: dict[str, int] = {}
    with open_input(path) as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                request, items = _check_line(lineno, raw, options, seen)
            except RequestError as exc:
                yield lineno, None, [], Problem(lineno, exc.code, str(exc), exc.param, _custom_id(raw))
                continue
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
                # a body no check foresaw: that line's error, never the whole file's
                yield lineno, None, [], Problem(lineno, "invalid_request", f"the request cannot be read "
                                                f"({type(exc).__name__}: {exc})", "body", _custom_id(raw))
                continue
            yield lineno, request, items, None


def _custom_id(raw: bytes) -> str | None:
    try:
        value = json_line(raw)
    except ValueError:
        return None
    cid = value.get("custom_id") if isinstance(value, dict) else None
    return cid if isinstance(cid, str) else None


def validate_batch_file(path: str, options: Options, limit: int | None = None) -> Report:
    """Check every line of ``path`` (the first ``limit`` request lines); nothing runs."""
    report = Report()
    for lineno, request, items, problem in iter_requests(path, options):
        if limit is not None and report.lines >= limit:
            break
        report.lines += 1
        if problem is not None:
            report.problems.append(problem)
            report.rows += 1
            continue
        report.rows += len(items)
        report.urls.add(request["url"])
        if request["body"].get("model") is not None:
            report.models.add(request["body"]["model"])
    return report


def read_openai_batch(path: str, options: Options, limit: int | None = None,
                      batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[list[dict[str, Any]]]:
    """The rows of a batch file: ``custom_id``, ``line``, ``url``, ``body`` (JSON text),
    ``model``, ``sub`` and ``subs``, and :data:`~llmbatch.io.readers.READ_ERROR` (``read: <code>: ...``)."""
    yield from batched(_records(path, options, limit), batch_rows)


def _records(path: str, options: Options, limit: int | None) -> Iterator[Record]:
    """Each line's rows (one per input item) with their read errors, up to ``limit`` lines."""
    lines = 0
    for lineno, request, items, problem in iter_requests(path, options):
        if limit is not None and lines >= limit:
            break
        lines += 1
        if problem is not None:
            yield ({"custom_id": problem.custom_id, "line": lineno, "url": None, "body": None, "model": None,
                    "sub": 0, "subs": 1}, f"read: {problem.code}: line {lineno}: {problem.message}")
            continue
        body = request["body"]
        key = "prompt" if request["url"] == COMPLETIONS else "input"
        for sub, item in enumerate(items):
            one = {**body, key: item} if len(items) > 1 else body
            try:
                text, error = json.dumps(one, ensure_ascii=False), ""
            except (ValueError, RecursionError) as exc:
                text, error = None, f"read: invalid_request: line {lineno}: the body cannot be written ({exc})"
            yield ({"custom_id": request["custom_id"], "line": lineno, "url": request["url"], "body": text,
                    "model": body.get("model"), "sub": sub, "subs": len(items)}, error)


def peek(path: str) -> tuple[str | None, str | None]:
    """(the first model named, the first url) in a batch file: what a job with no model or
    task_type of its own runs."""
    model = url = None
    with open_input(path) as fh:
        for raw in fh:
            try:
                value = json_line(raw)
            except ValueError:
                continue
            if not isinstance(value, dict):
                continue
            url = url or (value.get("url") if isinstance(value.get("url"), str) else None)
            body = value.get("body")
            if isinstance(body, dict) and isinstance(body.get("model"), str):
                model = model or body["model"]
            if model and url:
                break
    return model, url
