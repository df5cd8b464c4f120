"""A shared Ray Serve deployment behind the engine base class.

Several processors (a draft step, then a critique step over its output) send their rows to one
engine deployed with Ray Serve, so the model loads once. Rows carry Ray's contract: ``method``
(the deployment's method, e.g. ``chat``), ``dtype`` (a request class named in
``dtype_mapping``; none: a plain dict) and ``request_kwargs``; the response's fields are merged
into the row, as in Ray. Rows may instead ask as they do for the local engine
(``messages``/``prompt``, ``sampling_params``): they are sent as OpenAI chat/completions
requests and come back with ``generated_text`` and the token usage.

Works with llmbatch's own deployment (:func:`llmbatch.build_llm_deployment`) and with Ray
Serve LLM's ``LLMServer``. A replica that dies mid-request is not the row's fault: the request
waits for Serve to bring a replica back and runs again.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import Any

from llmbatch.engines.base import Engine, Request
from llmbatch.engines.settings import ServeSettings
from llmbatch.engines.openai_api import (
    CHAT,
    answer_columns,
    is_deterministic,
    request_body,
    usage_counts,
)
from llmbatch.errors import EndpointTimeoutError, EngineStartError, RowValidationError
from llmbatch.rows import Row, to_python

logger = logging.getLogger(__name__)

#: Ray errors that mean the replica (not the row) failed: wait for Serve, then run the row again.
REPLICA_ERRORS = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError",
                  "BackPressureError", "DeploymentUnavailableError", "RaySystemError", "WorkerCrashedError",
                  "NodeDiedError", "ObjectLostError", "OwnerDiedError")
#: Seconds to wait before a row runs again after its replica died (Serve starts a new one, and
#: routes the row to it once it is up), and how many times a row may meet a dead replica.
REPLICA_RETRY_WAIT_S = 2.0
REPLICA_ATTEMPTS = 8


def _error_names(exc: BaseException) -> set[str]:
    names = {cls.__name__ for cls in type(exc).__mro__}
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        names |= {cls.__name__ for cls in type(cause).__mro__}
    return names


class ServeEngine(Engine):
    """Rows to a Ray Serve deployment (see module docstring)."""

    required_any = (("request_kwargs", "messages", "prompt"),)

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.deployment_name = settings.deployment_name
        self.app_name = settings.app_name
        self.dtype_mapping = dict(settings.dtype_mapping or {})
        self.capacity = settings.max_concurrent_requests
        self.handle = None
        self._streaming: dict[str, bool] = {}
        self._ids = itertools.count()

    async def start(self) -> None:
        from ray import serve

        try:
            apps = serve.status().applications
        except Exception as exc:  # noqa: BLE001 - Serve is not running on this cluster
            raise EngineStartError(f"Ray Serve is not running here ({type(exc).__name__}: {exc}); deploy the "
                                   "engine first: serve.run(build_llm_deployment(...), name=...)") from exc
        app = apps.get(self.app_name)
        if app is None or self.deployment_name not in app.deployments:
            running = {name: sorted(a.deployments) for name, a in apps.items()}
            raise EngineStartError(
                f"no Serve deployment {self.deployment_name!r} in application {self.app_name!r} (running: "
                f"{running or 'none'}); deploy it first, e.g. serve.run(build_llm_deployment(config, "
                f"name={self.deployment_name!r}), name={self.app_name!r})")
        self.handle = serve.get_deployment_handle(self.deployment_name, self.app_name)

    async def restart(self) -> None:
        """The replica died: Serve replaces it; wait a moment before the row runs again."""
        await asyncio.sleep(REPLICA_RETRY_WAIT_S)

    async def close(self) -> None:
        self.handle = None

    def is_fatal(self, exc: BaseException) -> bool:
        return bool(_error_names(exc) & set(REPLICA_ERRORS))

    # -- requests ----------------------------------------------------------------------------

    def build_request(self, row: Row) -> Request:
        if row.get("request_kwargs") is not None or row.get("method") is not None:
            method = row.get("method")
            if not isinstance(method, str) or not method:
                raise RowValidationError("the row needs 'method', the deployment's method to call (e.g. 'chat')")
            kwargs = to_python(row.get("request_kwargs"))
            if not isinstance(kwargs, dict):
                raise RowValidationError(f"'request_kwargs' must be a dict, got {type(kwargs).__name__}")
            dtype = self._dtype(row.get("dtype"))
            return Request(prompt=method, params=(dtype, kwargs), extra={"kind": None, "structured": None})
        kind, body, spec = request_body(row, self.settings.model, self.settings.structured_output_fields)
        dtype = self.dtype_mapping.get("ChatCompletionRequest" if kind == CHAT else "CompletionRequest")
        key = json.dumps(body, sort_keys=True, default=str) if self.settings.dedup_requests and is_deterministic(body) else None
        prompt = row["prompt"] if kind != CHAT else ""
        return Request(prompt=kind, params=(dtype, body), key=key,
                       extra={"kind": kind, "structured": spec, "prompt": prompt})

    def _dtype(self, name: Any) -> Any:
        if name is None:
            return None
        if name not in self.dtype_mapping:
            raise RowValidationError(f"dtype {name!r} is not in the config's dtype_mapping "
                                     f"(it has {sorted(self.dtype_mapping) or 'nothing'})")
        return self.dtype_mapping[name]

    async def _call(self, method: str, obj: Any) -> Any:
        """The deployment's first response (a streaming method, as Ray's LLMServer has), or its
        result (a plain method)."""
        if self._streaming.get(method, True):
            stream = getattr(self.handle.options(stream=True), method).remote(obj)
            try:
                return await stream.__anext__()
            except Exception as exc:  # noqa: BLE001 - a method that is not a generator: call it plainly
                if "did not return a generator" not in str(exc):
                    raise
                self._streaming[method] = False
        return await getattr(self.handle, method).remote(obj)

    async def run(self, request: Request) -> dict[str, Any]:
        request_id = next(self._ids)
        dtype, kwargs = request.params
        kwargs = {"request_id": str(request_id), **kwargs} if request.extra["kind"] is None else dict(kwargs)
        try:
            obj = dtype(**kwargs) if dtype is not None else kwargs
        except Exception as exc:  # noqa: BLE001 - the request class refused the row's fields
            raise RowValidationError(f"{getattr(dtype, '__name__', dtype)} refused the request: {exc}") from exc
        start = time.perf_counter()
        call = self._call(request.prompt, obj)
        try:
            output = await (asyncio.wait_for(call, self.settings.request_timeout_s) if self.settings.request_timeout_s else call)
        except asyncio.TimeoutError:
            raise EndpointTimeoutError(f"no answer from the deployment within request_timeout_s="
                                       f"{self.settings.request_timeout_s:g} s") from None
        except Exception as exc:
            cause = getattr(exc, "cause", None)
            if self.is_fatal(exc) or not isinstance(cause, Exception):
                raise
            raise cause from None  # the deployment's own error (not Ray's wrapper with its traceback)
        elapsed = time.perf_counter() - start
        if hasattr(output, "model_dump"):
            output = output.model_dump()
        if not isinstance(output, dict):
            output = {"response": output}
        prompt_tokens, completion_tokens, cached = usage_counts(output)
        base = {"num_input_tokens": prompt_tokens, "num_generated_tokens": completion_tokens, "time_taken_llm": elapsed,
                "request_id": request_id, "num_cached_tokens": cached}
        if request.extra["kind"] is None:
            return {**output, **base, "time_taken": elapsed}  # Ray's contract: the response's fields
        return {**base, **answer_columns(request.extra["kind"], output, request.extra.get("prompt", ""))}
