"""What identifies a job's answers: the settings that decide them, the code of its functions,
the model's files; and the settings that may change them only in near-ties.

``resume`` compares these with what ``job.json`` recorded. How a setting counts is metadata
on the config field itself (``resume`` in :mod:`llmbatch.config`: "placement" never changes
an answer, "numerics" may change a near-tie); every other setting decides answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from typing import Any

from llmbatch.config import (
    ENGINE_KWARGS_RESUME,
    ChatTemplateStageConfig,
    DetokenizeStageConfig,
    PrepareMultimodalStageConfig,
    TokenizerStageConfig,
    resume_kind,
)
from llmbatch.jobs.spec import PROCESSOR_CONFIGS, JobSpec, load_function
from llmbatch.models import ALIASES

_STAGES = {"chat_template_stage": ChatTemplateStageConfig, "tokenize_stage": TokenizerStageConfig,
           "detokenize_stage": DetokenizeStageConfig, "prepare_multimodal_stage": PrepareMultimodalStageConfig}


def _module_sources(fn: Any, python_path: list[str]) -> dict[str, str]:
    """sha256 of the source of ``fn``'s module and of every module loaded from the job's own
    folders (its helpers and constants), by module name."""
    folders = [os.path.realpath(f) for f in python_path]
    installed = [os.path.realpath(p) for p in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                               sysconfig.get_paths()["platlib"], sys.prefix)]
    names = {getattr(fn, "__module__", None)}
    for name, module in list(sys.modules.items()):
        origin = os.path.realpath(getattr(module, "__file__", None) or "/")
        if any(origin.startswith(f + os.sep) for f in installed):
            continue  # installed packages are identified by their versions, not here
        if any(origin.startswith(f + os.sep) for f in folders):
            names.add(name)
    out = {}
    for name in sorted(n for n in names if n):
        origin = getattr(sys.modules.get(name), "__file__", None)
        if origin and os.path.exists(origin):
            with open(origin, "rb") as fh:
                out[name] = hashlib.sha256(fh.read()).hexdigest()[:16]
    return out


def _function_identity(ref: str | None, python_path: list[str]) -> Any:
    if ref is None:
        return None
    fn = load_function(ref, python_path)
    sources = _module_sources(fn, python_path)
    if not sources:  # a function without a source file: its compiled code and constants
        import cloudpickle

        sources = {"pickled": hashlib.sha256(cloudpickle.dumps(fn)).hexdigest()[:16]}
    return {"ref": ref, "sources": sources}


def model_fingerprint(source: str) -> Any:
    """What identifies the model's content without loading it: for a local folder, its
    config.json and the names and sizes of its weight and tokenizer files; for an offline
    alias, the package that ships it; otherwise (hub id, object storage) the name itself."""
    if source in ALIASES:
        return {"alias": source, "package": ALIASES[source].package}
    path = os.path.expanduser(source)
    if not os.path.isdir(path):
        return {"name": source}
    files = {}
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_file() and entry.name.endswith((".safetensors", ".bin", ".gguf", ".pt", ".model", ".json",
                                                    ".txt", ".jinja", ".tiktoken")):
            files[entry.name] = entry.stat().st_size
    config = os.path.join(path, "config.json")
    digest = None
    if os.path.exists(config):
        with open(config, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()[:16]
    return {"folder": os.path.abspath(path), "config_sha256": digest, "files": files}


def _flat(nested: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value

    walk("", nested)
    return flat


def _model_settings(spec: JobSpec, kind: str | None) -> dict[str, Any]:
    """The model section's settings whose ``resume`` kind is ``kind`` (None: answer-deciding)."""
    cls = PROCESSOR_CONFIGS[spec.model.processor]
    out: dict[str, Any] = {}
    for key, value in spec.model.processor_fields().items():
        if key == "engine_kwargs":
            out[key] = {k: v for k, v in dict(value or {}).items() if ENGINE_KWARGS_RESUME.get(k) == kind}
        elif key in _STAGES and isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if resume_kind(_STAGES[key], k) == kind}
        elif resume_kind(cls, key) == kind:
            out[key] = value
    return out


def result_fields(spec: JobSpec) -> dict[str, Any]:
    """The job settings that decide the answers, flattened to dotted keys.

    Two runs with equal result fields and the same input give the same rows; ``resume``
    refuses a job directory whose result fields differ from the job it is given. A job's kind
    adds its own (``Job.result_fields``).
    """
    model = _model_settings(spec, None)
    nested = {
        "input": {"format": spec.input.format, "limit": spec.input.limit, "columns": spec.input.columns,
                  "id_column": spec.input.id_column},
        "model": {"source": spec.model.source, "processor": spec.model.processor, **model,
                  "engine_kwargs": model.pop("engine_kwargs", {}), "fingerprint": model_fingerprint(spec.model.source)},
        "prompt": spec.prompt.model_dump() if spec.prompt else None,
        "preprocess": _function_identity(spec.preprocess, spec.python_path),
        "postprocess": _function_identity(spec.postprocess, spec.python_path),
        "sampling_params": spec.sampling_params,
    }
    return _flat(nested)


def numerics_fields(spec: JobSpec) -> dict[str, Any]:
    """The settings that can change a greedy answer in a near-tie (``resume`` "numerics")."""
    return _flat({"model": _model_settings(spec, "numerics")})


def config_hash(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def diff_fields(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two result-field dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if json_norm(a) != json_norm(b):
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def json_norm(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))
