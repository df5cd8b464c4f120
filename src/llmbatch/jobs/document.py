"""The job document before it is a spec: ``--set`` overrides, other documents merged in, paths
made relative to the job file's folder, ``${VAR}`` read from the environment outside the prompt
text, the sections a job cannot run without named by their flags, and what an OpenAI batch
file fills in (its model and task, public media)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from llmbatch.errors import ConfigError
from llmbatch.models import ALIASES
from llmbatch.openai.batch_file import FORMAT as OPENAI_BATCH
from llmbatch.openai.batch_file import peek
from llmbatch.openai.vocab import EMBEDDINGS
from llmbatch.redact import expand_env

#: Keys whose values are prompt text, or what constrains or stops the answer: taken as written,
#: so ``$`` there is a ``$`` (``"Price: ${price}"`` is a dollar sign and the row's field
#: ``{price}``), never an environment variable. ``${VAR}`` anywhere else (secrets, paths,
#: engine settings) is read from the environment.
AS_WRITTEN = ("prompt", "sampling_params", "pooling_params", "chat_template")
#: The model ``--task embed`` runs when the job names none: the shipped embedding model.
EMBED_MODEL = next(name for name, m in ALIASES.items() if m.task == "embed")
PROMPT_SOURCES = ("user", "messages_column", "prompt_column", "text_column", "pair_columns")


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set takes key.path=value, got {item!r}")
    key, _, raw = item.partition("=")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML) to a job dict."""
    for item in overrides or []:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def _relative_to(base: Path, value: str | None) -> str | None:
    if value is None or "://" in value or os.path.isabs(value) or value.startswith("${"):
        return value
    return str((base / value).resolve()) if not value.startswith("~") else os.path.expanduser(value)


def resolve_paths(data: dict[str, Any], base: Path, job_file_folder: bool = True) -> dict[str, Any]:
    """Make the job's relative paths relative to ``base`` (the job file's folder, which is
    also where preprocess/postprocess modules are imported from; a job given as data only,
    e.g. resumed from its directory, adds no folder of its own)."""
    if isinstance(data.get("input"), dict):
        data["input"]["path"] = _relative_to(base, data["input"].get("path"))
    if isinstance(data.get("output"), dict):
        data["output"]["path"] = _relative_to(base, data["output"].get("path"))
    if isinstance(data.get("output"), dict) and data["output"].get("errors_path"):
        data["output"]["errors_path"] = _relative_to(base, data["output"]["errors_path"])
    if data.get("job_dir"):
        data["job_dir"] = _relative_to(base, data["job_dir"])
    if data.get("preprocess") or data.get("postprocess"):
        paths = [_relative_to(base, p) for p in data.get("python_path") or []]
        data["python_path"] = list(dict.fromkeys(paths + ([str(base)] if job_file_folder else [])))
    model = data.get("model")
    if isinstance(model, dict):
        src = model.get("source", model.get("model_source"))
        if isinstance(src, str) and src.startswith(("./", "../")):
            model["source"] = _relative_to(base, src)
            model.pop("model_source", None)
    return data


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif value is not None:
            out[key] = value
    return out


def expand_environment(doc: dict[str, Any]) -> dict[str, Any]:
    """``${VAR}`` replaced by the environment's value everywhere but :data:`AS_WRITTEN`."""
    return expand_env(doc, keep=AS_WRITTEN)


def _section(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = doc.get(name)
    return value if isinstance(value, dict) else None


def fill_defaults(doc: dict[str, Any]) -> dict[str, Any]:
    """An embed job that names no model gets the shipped embedding model."""
    model = {} if doc.get("model") is None else doc["model"]
    if not isinstance(model, dict) or model.get("source") or model.get("model_source"):
        return doc
    if (doc.get("task") or model.get("task_type")) == "embed":
        doc["model"] = {**model, "source": EMBED_MODEL}
    return doc


def check_required(doc: dict[str, Any]) -> None:
    """What every job needs (input, model, output, a prompt), each named by its flag and its job
    file field when missing; what is there but wrong is the spec's to say."""
    inp, model, out = _section(doc, "input"), _section(doc, "model"), _section(doc, "output")
    batch = inp is not None and inp.get("format") == OPENAI_BATCH
    if doc.get("input") is None or (inp is not None and not inp.get("path")):
        raise ConfigError("--input is missing: give --input FILE (input.path in a job file), or --openai-batch "
                          "FILE for an OpenAI batch file")
    if batch and "://" not in str(inp["path"]) and not os.path.exists(str(inp["path"])):
        raise ConfigError(f"--openai-batch (input.path): {inp['path']} does not exist; give an existing file")
    if doc.get("model") is None or (model is not None and not (model.get("source") or model.get("model_source"))):
        if batch:
            raise ConfigError("--model is missing and no request in the batch file names one: pass --model "
                              "(model.source in a job file) or name the model in each line's body")
        raise ConfigError("--model is missing: give -m MODEL (model.source in a job file): an offline alias "
                          f"such as {next(iter(ALIASES))} (llmbatch models list), a model folder or a hub id")
    if doc.get("output") is None or (out is not None and not out.get("path")):
        raise ConfigError("--output is missing: give --output FILE (.parquet, .jsonl or .csv; output.path in a "
                          "job file)")
    prompt = _section(doc, "prompt")
    if batch or doc.get("preprocess") or (doc.get("prompt") is not None and prompt is None):
        return
    if prompt is None or not any(prompt.get(key) is not None for key in PROMPT_SOURCES):
        raise ConfigError("--prompt is missing: give --prompt 'What industry is {Company} in?' (a template over "
                          "the input's columns; prompt.user in a job file), --text-column for embed or classify, "
                          "--pair-columns for score, or preprocess: module:function")


def apply_openai_defaults(doc: dict[str, Any]) -> dict[str, Any]:
    """Fill a batch job's model from its file when the job does not name one: ``model.source``
    from the first request's ``model``, ``task_type`` embed for an embedding model or file."""
    inp = doc.get("input")
    if not isinstance(inp, dict) or inp.get("format") != OPENAI_BATCH or not isinstance(inp.get("path"), str):
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
