"""Shared engines: llmbatch's engine as a Ray Serve deployment.

```python
from ray import serve
from llmbatch import LLMConfig, ServeDeploymentProcessorConfig, build_llm_deployment, build_processor

app = build_llm_deployment(LLMConfig(model_loading_config=dict(model_id="smol", model_source="smollm2-135m-instruct"),
                                     engine_kwargs=dict(max_model_len=512)), name="llm")
serve.run(app, name="llm_app")
config = ServeDeploymentProcessorConfig(deployment_name="llm", app_name="llm_app")
draft, critique = build_processor(config, preprocess=...), build_processor(config, preprocess=...)
```

Each replica runs the same stages as ``vLLMEngineProcessorConfig`` (chat template, tokenize,
vLLM with llmbatch's CPU defaults, detokenize) on the same engine settings, so a request gets
the answer the offline processor gives. Its methods take OpenAI requests (dicts, or pydantic
models such as Ray Serve LLM's ``ChatCompletionRequest``) and stream one OpenAI response, as
Ray Serve LLM's ``LLMServer`` does: ``chat``, ``completions``; and ``generate``, which takes an
llmbatch row (``messages``/``prompt``, ``sampling_params``) and returns its output columns.
"""

from __future__ import annotations

import logging
from typing import Any

from llmbatch.builders import build_layout
from llmbatch.cluster import ensure_ray
from llmbatch.config import LLMConfig, vLLMEngineProcessorConfig
from llmbatch.engines.openai_api import (
    CHAT,
    COMPLETIONS,
    response_body,
    row_from_request,
)
from llmbatch.errors import ConfigError, MissingDependencyError
from llmbatch.processor import engine_cpu_share
from llmbatch.rows import ERROR_COLUMN, PRIVATE_PREFIX, REQUEST_COLUMNS, Row, is_error
from llmbatch.stages.runner import run_stages

logger = logging.getLogger(__name__)

#: Requests one replica takes at once by default (Serve's own default is 5): the engine
#: batches them, and llmbatch's engine stage bounds what is inside vLLM.
MAX_ONGOING_REQUESTS = 4096


class LLMServer:
    """llmbatch's engine stages as a Ray Serve deployment (see module docstring)."""

    async def __init__(self, engine_config: dict[str, Any], model_id: str):
        # the deployment is the long-lived engine itself: no warm host behind it
        config = vLLMEngineProcessorConfig(**{**engine_config, "should_continue_on_error": True, "keep_warm_s": 0})
        layout = build_layout(config)
        self.stages = [s.stage for s in layout.pre] + [layout.engine] + [s.stage for s in layout.post]
        self.model_id = model_id
        for stage in self.stages:
            await stage.start()

    async def _answer(self, row: Row) -> Row:
        out: list[Row] = []
        async for chunk in run_stages(self.stages, [row]):
            out.extend(chunk)
        answered = out[0]
        if is_error(answered):
            raise ValueError(answered[ERROR_COLUMN])  # Ray's recoverable error: the row's, not the replica's
        return answered

    async def chat(self, request: Any):
        yield response_body(CHAT, self.model_id, await self._answer(row_from_request(CHAT, request)))

    async def completions(self, request: Any):
        yield response_body(COMPLETIONS, self.model_id, await self._answer(row_from_request(COMPLETIONS, request)))

    async def generate(self, row: dict[str, Any]):
        answered = await self._answer(dict(row))
        yield {k: v for k, v in answered.items() if not k.startswith(PRIVATE_PREFIX) and k not in REQUEST_COLUMNS}

    async def __del__(self):
        for stage in getattr(self, "stages", []):
            try:
                await stage.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                logger.debug("closing a stage failed", exc_info=True)


def _engine_config(llm_config: Any) -> tuple[vLLMEngineProcessorConfig, str, dict[str, Any]]:
    """(engine config, model id, Serve options) from an llmbatch or Ray Serve LLM config."""
    if isinstance(llm_config, vLLMEngineProcessorConfig):
        lo, hi = llm_config.concurrency_range()
        options = {"num_replicas": lo} if lo == hi else {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi}}
        return llm_config, llm_config.model_source, options
    if not isinstance(llm_config, LLMConfig):
        if not hasattr(llm_config, "model_loading_config"):
            raise ConfigError(f"build_llm_deployment takes an LLMConfig or a vLLMEngineProcessorConfig, not "
                              f"{type(llm_config).__name__}")
        data = llm_config.model_dump()  # Ray Serve LLM's LLMConfig: the fields llmbatch reads
        loading = data.get("model_loading_config") or {}
        llm_config = LLMConfig(model_loading_config={k: v for k, v in loading.items() if v is not None and k in (
            "model_id", "model_source")}, engine_kwargs=data.get("engine_kwargs") or {},
            deployment_config=data.get("deployment_config") or {}, accelerator_type=data.get("accelerator_type"),
            runtime_env=data.get("runtime_env"))
    engine = vLLMEngineProcessorConfig(model_source=llm_config.model_source(), engine_kwargs=llm_config.engine_kwargs,
                                       accelerator_type=llm_config.accelerator_type, runtime_env=llm_config.runtime_env)
    return engine, llm_config.model_id(), dict(llm_config.deployment_config)


def build_llm_deployment(llm_config: LLMConfig | vLLMEngineProcessorConfig | Any, *, name: str | None = None,
                         name_prefix: str | None = None, override_serve_options: dict[str, Any] | None = None):
    """A Ray Serve application serving llmbatch's engine for ``llm_config`` (an :class:`LLMConfig`,
    a ``vLLMEngineProcessorConfig`` with the same engine kwargs as an offline processor, or Ray
    Serve LLM's ``LLMConfig``). Deploy it with ``serve.run(app, name=APP)``; processors reach it
    with ``ServeDeploymentProcessorConfig(deployment_name=name, app_name=APP)``.

    The deployment is named ``name`` (default: ``name_prefix`` + the model id, Ray's way).
    On a cluster without GPUs its replicas reserve no CPU unless two stay free beside them, as
    the offline engine replicas do.
    """
    try:
        from ray import serve
    except ImportError as exc:
        raise MissingDependencyError("build_llm_deployment (Ray Serve)", "ray[serve]") from exc
    import ray

    engine, model_id, options = _engine_config(llm_config)
    ensure_ray()
    cluster = ray.cluster_resources()
    replicas = int(options.get("num_replicas") or (options.get("autoscaling_config") or {}).get("max_replicas") or 1)
    actor: dict[str, Any] = {}
    if cluster.get("GPU", 0) > 0:
        actor.update(num_gpus=engine.devices_per_replica(), num_cpus=1)
    else:
        actor["num_cpus"] = engine_cpu_share(cluster.get("CPU", 1), replicas, 0.0)
    if engine.accelerator_type:
        actor["accelerator_type"] = engine.accelerator_type
    if engine.runtime_env:
        actor["runtime_env"] = engine.runtime_env
    options = {"name": name or f"{name_prefix if name_prefix is not None else 'LLMServer:'}{model_id}",
               "max_ongoing_requests": MAX_ONGOING_REQUESTS, **options}
    options["ray_actor_options"] = {**actor, **(options.get("ray_actor_options") or {})}
    options.update(override_serve_options or {})
    data = engine.model_dump(exclude={"should_continue_on_error"})
    return serve.deployment(LLMServer).options(**options).bind(data, model_id)
