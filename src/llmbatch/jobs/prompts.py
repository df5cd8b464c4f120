"""Turning a job's prompt section into the preprocess function of its processor."""

from __future__ import annotations

import copy
from typing import Any

from llmbatch.errors import ConfigError, RowValidationError
from llmbatch.jobs.openai_batch import OpenAIBatchPreprocess, is_openai_batch
from llmbatch.jobs.spec import JobSpec, PromptSpec, load_function
from llmbatch.rows import is_missing


class _RowFields(dict):
    """Row values for ``str.format_map`` that reject missing and empty (None/NaN) fields."""

    def __missing__(self, key: str) -> Any:
        raise RowValidationError(f"template field {{{key}}} is not a column of this row")

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        if is_missing(value):
            raise RowValidationError(f"template field {{{key}}} is empty (None/NaN) in this row; fill it or drop the row")
        return value


def render(template: str, row: dict[str, Any]) -> str:
    return template.format_map(_RowFields(row))


class TemplatePreprocess:
    """``row -> {messages | prompt, sampling_params}`` from a job's prompt section."""

    def __init__(self, prompt: PromptSpec, sampling_params: dict[str, Any]):
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
            value = row.get(p.prompt_column)
            if is_missing(value) or not str(value).strip():
                raise RowValidationError(f"column {p.prompt_column!r} (the prompt) is empty in this row")
            out["prompt"] = str(value)
            return out
        if p.messages_column is not None:
            value = row.get(p.messages_column)
            if is_missing(value):
                raise RowValidationError(f"column {p.messages_column!r} (the messages) is empty in this row")
            if isinstance(value, str):
                import json

                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise RowValidationError(f"column {p.messages_column!r} is not a JSON list of messages: {exc}") from exc
            out["messages"] = value
            return out
        messages = []
        if p.system:
            messages.append({"role": "system", "content": render(p.system, row)})
        messages.append({"role": "user", "content": render(p.user, row)})
        out["messages"] = messages
        return out


class WithDefaultParams:
    """A user preprocess whose rows get the job's sampling_params as defaults."""

    def __init__(self, fn, sampling_params: dict[str, Any]):
        self.fn = fn
        self.sampling_params = sampling_params

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        out = self.fn(row)
        if isinstance(out, dict) and self.sampling_params:
            out = {**out, "sampling_params": {**self.sampling_params, **(out.get("sampling_params") or {})}}
        return out


def job_preprocess(spec: JobSpec):
    """The preprocess a job's processor runs: its prompt templates, or its own function with
    the job's sampling_params as defaults."""
    if is_openai_batch(spec):
        return OpenAIBatchPreprocess(spec.sampling_params)
    if spec.prompt is not None:
        return TemplatePreprocess(spec.prompt, spec.sampling_params)
    return WithDefaultParams(load_function(spec.preprocess, spec.python_path), spec.sampling_params)


def check_prompt_fields(spec: JobSpec, columns: list[str]) -> None:
    """Fail before any work when the prompt names a field the input does not have."""
    if spec.prompt is None:
        return
    missing = [f for f in spec.prompt.fields() if f not in columns]
    if missing:
        raise ConfigError(
            f"the prompt uses {', '.join('{' + m + '}' for m in missing)}, which the input does not have. "
            f"Input columns: {', '.join(columns)}"
        )
