"""The job document before it is a spec: ``--set`` overrides, other documents merged in, and
paths made relative to the job file's folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from llmbatch.errors import ConfigError


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
