"""Turning a job's prompt section into the preprocess function of its processor."""

from __future__ import annotations

import _string
import copy
import functools
import json
import string
from typing import Any

from llmbatch.errors import ConfigError, RowValidationError
from llmbatch.jobs.spec import JobSpec, PromptSpec, load_function
from llmbatch.rows import is_missing


class _RowFields(dict):
    """Row values for ``str.format_map`` that reject missing and empty (None/NaN) fields."""

    def __missing__(self, key: str) -> Any:
        raise RowValidationError(f"template field {{{key}}} is not a column of this row")

    def __getitem__(self, key: str) -> Any:
        return _filled(super().__getitem__(key), key)


def _filled(value: Any, field: str) -> Any:
    if is_missing(value):
        raise RowValidationError(f"template field {{{field}}} is empty (None/NaN) in this row; fill it or drop the row")
    return value


def render(template: str, row: dict[str, Any]) -> str:
    """``template`` over ``row``'s fields: ``{Company}``, and a nested value's parts as in a Jinja
    template or Python's own format: ``{meta.title}``, ``{meta[title]}``, ``{tags[0]}``."""
    if not _nested(template):
        return template.format_map(_RowFields(row))
    return _FORMATTER.vformat(template, (), _RowFields(row))


@functools.lru_cache(maxsize=256)
def _nested(template: str) -> bool:
    return any(field and ("." in field or "[" in field) for _, field, _, _ in string.Formatter().parse(template))


class _RowFormatter(string.Formatter):
    """``str.format`` for fields that read into a value. A column whose name holds the dot or
    bracket is read whole; a dict's key or a list's item is read for ``.key`` and ``[key]``; a
    value's attributes never (Python's ``{review.upper}`` put "<built-in method upper of str
    object at 0x...>" into the prompt)."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        if dict.__contains__(kwargs, field_name):
            return kwargs[field_name], field_name
        first, rest = _string.formatter_field_name_split(field_name)
        value = kwargs[first]
        for _, key in rest:
            value = _part(value, key, field_name)
        return _filled(value, field_name), first


def _part(value: Any, key: Any, field: str) -> Any:
    if isinstance(value, dict):
        for k in (key, str(key)):
            if k in value:
                return value[k]
        raise RowValidationError(f"template field {{{field}}}: {key!r} is not a key of this row's value "
                                 f"(its keys: {', '.join(map(str, list(value)[:10]))})")
    if isinstance(value, (list, tuple)) and (isinstance(key, int) or str(key).isdigit()):
        if int(key) < len(value):
            return value[int(key)]
        raise RowValidationError(f"template field {{{field}}}: this row's list has {len(value)} items, no [{key}]")
    raise RowValidationError(f"template field {{{field}}}: this row's value is {type(value).__name__}, which has no "
                             f"field {key!r} (a template reads a dict's keys and a list's items)")


_FORMATTER = _RowFormatter()


def _text(row: dict[str, Any], column: str, what: str) -> str:
    value = row.get(column)
    if is_missing(value) or not str(value).strip():
        raise RowValidationError(f"column {column!r} ({what}) is empty in this row")
    return str(value)


class PoolingPreprocess:
    """``row -> {prompt | text_1 + text_2, pooling_params}`` for embed, classify and score:
    the text as is (a column, or a ``prompt.user`` template), or the pair of columns."""

    def __init__(self, prompt: PromptSpec, pooling_params: dict[str, Any], task: str):
        prompt.check_task(task)
        self.prompt = prompt
        self.pooling_params = dict(pooling_params or {})

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        p = self.prompt
        out: dict[str, Any] = {"pooling_params": dict(self.pooling_params)}
        if p.pair_columns is not None:
            out["text_1"] = _text(row, p.pair_columns[0], "the first text of the pair")
            out["text_2"] = _text(row, p.pair_columns[1], "the second text of the pair")
        elif p.user is not None:
            out["prompt"] = render(p.user, row)
        else:
            out["prompt"] = _text(row, p.text_column or p.prompt_column, "the text")
        return out


class TemplatePreprocess:
    """``row -> {messages | prompt, sampling_params}`` from a job's prompt section."""

    def __init__(self, prompt: PromptSpec, sampling_params: dict[str, Any]):
        prompt.check_task("generate")
        self.prompt = prompt
        params = copy.deepcopy(sampling_params or {})
        constraint = None
        if prompt.choices is not None:
            constraint = {"choice": list(prompt.choices)}
        elif prompt.json_schema is not None:
            constraint = {"json": prompt.json_schema}
        elif prompt.regex is not None:
            constraint = {"regex": prompt.regex}
        if constraint is not None:
            params["structured_outputs"] = {**params.get("structured_outputs", {}), **constraint}
        self.sampling_params = params

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        p = self.prompt
        out: dict[str, Any] = {"sampling_params": copy.deepcopy(self.sampling_params)}
        if p.prompt_column is not None:
            out["prompt"] = _text(row, p.prompt_column, "the prompt")
            return out
        if p.messages_column is not None:
            value = row.get(p.messages_column)
            if is_missing(value):
                raise RowValidationError(f"column {p.messages_column!r} (the messages) is empty in this row")
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except (ValueError, RecursionError) as exc:
                    raise RowValidationError(f"column {p.messages_column!r} is not a JSON list of messages: {exc}") from exc
            out["messages"] = value
            return out
        messages = []
        if p.system:
            messages.append({"role": "system", "content": render(p.system, row)})
        text = render(p.user, row)
        media = [{"type": kind, kind: _media(row, column, kind)}
                 for kind, column in (("image", p.image_column), ("audio", p.audio_column)) if column is not None]
        if media:
            messages.append({"role": "user", "content": [*media, {"type": "text", "text": text}]})
        else:
            messages.append({"role": "user", "content": text})
        out["messages"] = messages
        return out


def _media(row: dict[str, Any], column: str, kind: str) -> Any:
    def empty(v: Any) -> bool:
        return is_missing(v) or (isinstance(v, (bytes, str)) and not v)

    value = row.get(column)
    if empty(value) or (isinstance(value, dict) and all(empty(value.get(k)) for k in ("bytes", "path", "url", "array"))):
        raise RowValidationError(f"column {column!r} (the {kind}) is empty in this row")
    return value


class WithDefaultParams:
    """A user preprocess whose rows get the job's sampling (or pooling) params as defaults."""

    def __init__(self, fn, params: dict[str, Any], key: str = "sampling_params"):
        self.fn = fn
        self.params = params
        self.key = key

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        out = self.fn(row)
        if isinstance(out, dict) and self.params:
            out = {**out, self.key: {**self.params, **(out.get(self.key) or {})}}
        return out


def job_preprocess(spec: JobSpec, task: str | None = None):
    """The preprocess a job over rows runs: its prompt templates, or its own function with the
    job's sampling_params (pooling_params for a pooling ``task``) as defaults."""
    task = task or spec.resolved_task()
    if spec.prompt is not None:
        if task != "generate":
            return PoolingPreprocess(spec.prompt, spec.pooling_params, task)
        return TemplatePreprocess(spec.prompt, spec.sampling_params)
    fn = load_function(spec.preprocess, spec.python_path)
    if task != "generate":
        return WithDefaultParams(fn, spec.pooling_params, "pooling_params")
    return WithDefaultParams(fn, spec.sampling_params)


def check_prompt_fields(spec: JobSpec, columns: list[str]) -> None:
    """Fail before any work when the prompt names a field the input does not have."""
    if spec.prompt is None:
        return
    missing = [f for f in spec.prompt.fields(columns) if f not in columns]
    if missing:
        raise ConfigError(
            f"--prompt (prompt.*): the prompt uses {', '.join('{' + m + '}' for m in missing)}, which the input does "
            "not have. "
            f"Input columns: {', '.join(columns)}"
        )
