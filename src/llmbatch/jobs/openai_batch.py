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

from llmbatch.models import ALIASES
from llmbatch.openai.batch_file import FORMAT, BatchFileError, Options, peek, validate_batch_file
from llmbatch.openai.requests import translate
from llmbatch.openai.vocab import EMBEDDINGS
from llmbatch.rows import OPENAI

#: What the output lines need from an answered row (the request itself stays in input/).
KEEP = ("custom_id", "line", "url", "model", "sub", "subs", "encoding_format", "top_logprobs", "generated_text",
        "completions",
        "num_input_tokens", "num_generated_tokens", "finish_reason", "embeddings")


def is_openai_batch(spec: Any) -> bool:
    return spec.input.format == FORMAT


def served_names(spec: Any) -> list[str]:
    """The names a request's ``model`` may use: the served names, then the model source."""
    names = spec.model.served_model_name or []
    names = [names] if isinstance(names, str) else list(names)
    source = spec.model.source
    names.append(source)
    if os.path.isdir(os.path.expanduser(source)):
        names.append(os.path.basename(os.path.normpath(source)))
    return list(dict.fromkeys(names))


def batch_options(spec: Any) -> Options:
    """What a job's batch file is checked against: its model's names, its endpoint, its task."""
    return Options(models=served_names(spec), endpoint=spec.input.endpoint,
                   task_type=spec.processor_config().task_type)


def check_batch_file(spec: Any) -> Options:
    """The job's batch file checked line by line before any work: with ``invalid_lines: fail``
    every invalid line is listed (:class:`BatchFileError`); returns the options it was checked
    against (the job's rows are read with the same)."""
    options = batch_options(spec)
    if spec.input.invalid_lines == "fail":
        report = validate_batch_file(spec.input.path, options, spec.input.limit)
        if report.problems:
            raise BatchFileError(spec.input.path, report.problems)
    return options


def check_spec(spec: Any) -> None:
    """The rules an openai-batch job (or an openai-batch output) follows; raises ValueError."""
    if not is_openai_batch(spec):
        if spec.output.format == FORMAT:
            raise ValueError("output.format openai-batch needs input.format openai-batch")
        return
    if spec.prompt is not None or spec.preprocess is not None or spec.postprocess is not None:
        raise ValueError("an openai-batch input carries its own requests: leave out prompt, preprocess and "
                         "postprocess")
    if spec.input.id_column or spec.input.columns:
        raise ValueError("an openai-batch input has no id_column or columns: custom_id identifies each request")
    if spec.output.format is None:
        spec.output.format = FORMAT


def public_media(mm: Any) -> Any:
    """An openai-batch job's multimodal stage: media_access 'public' unless the job names one
    (its rows are what ``llmbatch serve`` runs for API clients; an operator running their own
    batch file sets ``model.prepare_multimodal_stage.media_access: local``)."""
    if mm is None or isinstance(mm, bool):
        return {"enabled": bool(mm), "media_access": "public"}
    if isinstance(mm, dict):
        return {"media_access": "public", **mm}
    if hasattr(mm, "model_fields_set") and "media_access" not in mm.model_fields_set:
        return mm.model_copy(update={"media_access": "public"})
    return mm


def apply_defaults(doc: dict[str, Any]) -> dict[str, Any]:
    """Fill a batch job's model from its file when the job does not name one: ``model.source``
    from the first request's ``model``, ``task_type`` embed for an embedding model or file."""
    inp = doc.get("input")
    if not isinstance(inp, dict) or inp.get("format") != FORMAT or not isinstance(inp.get("path"), str):
        return doc
    model = doc.setdefault("model", {})
    if not isinstance(model, dict):
        return doc
    needs_source = not (model.get("source") or model.get("model_source"))
    needs_task = "task_type" not in model and "task_type" not in (model.get("engine_kwargs") or {})
    if not (needs_source or needs_task):
        return doc
    try:
        first_model, first_url = peek(inp["path"])
    except Exception:  # noqa: BLE001 - an unreadable file is reported when the job reads it
        first_model = first_url = None
    if needs_source and first_model:
        model["source"] = first_model
    source = model.get("source") or model.get("model_source")
    if needs_task and ((source in ALIASES and ALIASES[source].task == "embed") or first_url == EMBEDDINGS):
        model["task_type"] = "embed"
    return doc


def errors_path(spec: Any) -> str:
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
