"""A job whose input is an OpenAI Batch API file (``input.format: openai-batch``).

The file's lines are the rows (``custom_id``, ``line``, ``url``, ``body``...; see
:mod:`llmbatch.openai.batch_file`); a built-in preprocess turns each body into the row's request
(:func:`llmbatch.openai.requests.translate`) and a built-in postprocess keeps what the
output lines need (:mod:`llmbatch.jobs.openai_output` writes them). The job's own settings
apply as for any job: the model section, ``sampling_params`` as defaults under each body's.
"""

from __future__ import annotations

import json
import os
from typing import Any

from llmbatch.jobs.spec import JobSpec
from llmbatch.openai.batch_file import BatchFileError, Options, validate_batch_file
from llmbatch.openai.requests import translate
from llmbatch.openai.vocab import EMBEDDINGS
from llmbatch.rows import OPENAI

#: What the output lines need from an answered row (the request itself stays in input/).
KEEP = ("custom_id", "line", "url", "model", "sub", "subs", "encoding_format", "top_logprobs", "generated_text",
        "completions",
        "num_input_tokens", "num_generated_tokens", "finish_reason", "embeddings")


def served_names(spec: JobSpec) -> list[str]:
    """The names a request's ``model`` may use: the served names, then the model source."""
    names = spec.model.served_model_name or []
    names = [names] if isinstance(names, str) else list(names)
    source = spec.model.source
    names.append(source)
    if os.path.isdir(os.path.expanduser(source)):
        names.append(os.path.basename(os.path.normpath(source)))
    return list(dict.fromkeys(names))


def batch_options(spec: JobSpec) -> Options:
    """What a job's batch file is checked against: its model's names, its endpoint, its task."""
    return Options(models=served_names(spec), endpoint=spec.input.endpoint,
                   task_type=spec.processor_config().task_type)


def check_batch_file(spec: JobSpec) -> Options:
    """The job's batch file checked line by line before any work: with ``invalid_lines: fail``
    every invalid line is listed (:class:`BatchFileError`); returns the options it was checked
    against (the job's rows are read with the same)."""
    options = batch_options(spec)
    if spec.input.invalid_lines == "fail":
        report = validate_batch_file(spec.input.path, options, spec.input.limit)
        if report.problems:
            raise BatchFileError(spec.input.path, report.problems)
    return options


def errors_path(spec: JobSpec) -> str:
    """Where the OpenAI error file goes: ``output.errors_path``, else beside the output."""
    if spec.output.errors_path:
        return spec.output.errors_path
    path = spec.output.path
    stem = path[: -len(".jsonl")] if path.endswith(".jsonl") else path
    return stem + ".errors.jsonl"


class OpenAIBatchPreprocess:
    """A batch line's body -> the row's request; the job's ``sampling_params`` are defaults.
    A body whose ``model`` is one of the job's own names (``served_names``: a served name, the
    source, the folder's name) asks the base model, not an adapter of that name; the answer's
    ``model`` is then the first served name, as vLLM's server answers."""

    def __init__(self, defaults: dict[str, Any] | None = None, base_names: list[str] | None = None):
        self.defaults = dict(defaults or {})
        self.base_names = frozenset(base_names or ())

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        body = json.loads(row["body"])
        out = translate(row["url"], body)
        if row.get("model") in self.base_names:
            out["model"] = None
        if "sampling_params" in out and self.defaults:
            out["sampling_params"] = {**self.defaults, **out["sampling_params"]}
            if "max_tokens" in out["sampling_params"] and out.get(OPENAI):
                out[OPENAI] = {**out[OPENAI], "max_tokens_auto": False}
        if row["url"] == EMBEDDINGS:
            out["encoding_format"] = body.get("encoding_format") or "float"
        elif "top_logprobs" in (out.get(OPENAI) or {}):
            out["top_logprobs"] = out[OPENAI]["top_logprobs"]
        return out


class OpenAIBatchPostprocess:
    """Keeps what an output line needs (the request stays in the job's staged input)."""

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        return {key: row[key] for key in KEEP if key in row}
