"""Builders: a processor config in, a :class:`~llmbatch.processor.Processor` out.

``build_processor(config, preprocess=..., postprocess=...)`` finds the builder registered for
the config's type and resolves the config once into a typed
:class:`~llmbatch.processor.Layout` (stages, pools, resources). Building has no side effects:
no ``ray.init``, no downloads, nothing global. A config that no builder can run fails here,
before any work. ``build_processor`` has Ray's signature exactly; llmbatch's own callers (the
job driver, ``verify``) use :func:`build_layout` with their own output stage last.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from llmbatch.config import (
    EndpointProcessorConfig,
    HttpRequestProcessorConfig,
    OfflineProcessorConfig,
    ProcessorConfig,
    ServeDeploymentProcessorConfig,
    SGLangEngineProcessorConfig,
    vLLMEngineProcessorConfig,
)
from llmbatch.engines.http import HttpEngine
from llmbatch.engines.serve import REPLICA_ATTEMPTS, ServeEngine
from llmbatch.engines.sglang import SGLangEngine, check_sglang_build
from llmbatch.engines.settings import EngineKwargs, HttpSettings, ServeSettings, SGLangSettings, VLLMSettings
from llmbatch.engines.vllm import VLLMEngine
from llmbatch.engines.vllm_chat import VllmChat
from llmbatch.errors import ConfigError
from llmbatch.processor import Layout, Processor, StageSpec
from llmbatch.redact import Secret, is_secret_key
from llmbatch.stages.chat_template import ChatTemplateStage
from llmbatch.stages.detokenize import DetokenizeStage
from llmbatch.stages.engine import EngineStage
from llmbatch.stages.multimodal import MediaPolicy, PrepareMultimodalStage
from llmbatch.stages.output import OutputStage
from llmbatch.stages.tokenize import TokenizeStage
from llmbatch.stages.warm import WarmEngineStage
from llmbatch.stages.user_fns import PostprocessStage, PreprocessStage

UserFn = Callable[[dict[str, Any]], dict[str, Any]]

Builder = Callable[..., Layout]
_REGISTRY: dict[type, Builder] = {}


def register(config_type: type) -> Callable[[Builder], Builder]:
    """Register the builder of layouts for ``config_type``."""

    def deco(fn: Builder) -> Builder:
        _REGISTRY[config_type] = fn
        return fn

    return deco


def builder_for(config: ProcessorConfig) -> Builder:
    """The builder for ``config``; a config no builder can run fails here, before any work."""
    if isinstance(config, SGLangEngineProcessorConfig):
        check_sglang_build()
    for cls in type(config).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    raise ConfigError(f"no processor for {type(config).__name__}; known: {', '.join(c.__name__ for c in _REGISTRY)}")


def build_processor(config: ProcessorConfig, preprocess: UserFn | None = None, postprocess: UserFn | None = None,
                    preprocess_map_kwargs: dict[str, Any] | None = None,
                    postprocess_map_kwargs: dict[str, Any] | None = None,
                    builder_kwargs: dict[str, Any] | None = None) -> Processor:
    """Build a processor for ``config`` (Ray's ``build_processor``/``build_llm_processor``, with
    its exact signature).

    ``preprocess(row) -> dict`` returns the request fields (``messages`` or ``prompt``,
    ``sampling_params``...); ``postprocess(row) -> dict`` returns the output row;
    ``builder_kwargs`` go to the config's builder (e.g. ``chat_template_kwargs``).
    """
    return Processor(config, build_layout(config, preprocess, postprocess, preprocess_map_kwargs=preprocess_map_kwargs,
                                          postprocess_map_kwargs=postprocess_map_kwargs, **(builder_kwargs or {})))


def build_layout(config: ProcessorConfig, preprocess: UserFn | None = None, postprocess: UserFn | None = None, *,
                 output: OutputStage | None = None, **builder_kwargs: Any) -> Layout:
    """The :class:`Layout` the config's builder resolves, ``output`` last: the stage that shapes
    the output rows (default: the public API's typed columns; the job layer's keeps its private
    keys and leaves the rows encoded for its driver). ``builder_kwargs`` go to the config's
    builder (``preprocess_map_kwargs``, ``chat_template_kwargs``...)."""
    layout = builder_for(config)(config, preprocess=preprocess, postprocess=postprocess, **builder_kwargs)
    layout.output = (output or OutputStage()).bind(task_type=layout.task_type,
                                                   continue_on_error=layout.continue_on_error,
                                                   postprocessed=postprocess is not None)
    return layout


build_llm_processor = build_processor


def vllm_settings(config: vLLMEngineProcessorConfig, engine_kwargs: EngineKwargs | None = None) -> VLLMSettings:
    """The vLLM engine's settings from its config (the replica's engine, and one the job's
    driver launches for it early: ``engines/vllm_early.py``)."""
    return VLLMSettings(model_source=config.model_source, task_type=config.task_type,
                        engine_kwargs=EngineKwargs(config.engine_kwargs) if engine_kwargs is None else engine_kwargs,
                        dynamic_lora_loading_path=config.dynamic_lora_loading_path, concurrency=config.concurrency,
                        detokenize_stage=config.detokenize_stage.enabled, log_engine_metrics=config.log_engine_metrics)


@register(vLLMEngineProcessorConfig)
def build_vllm_layout(config: vLLMEngineProcessorConfig, **kwargs: Any) -> Layout:
    """The vLLM layout: [preprocess] -> [multimodal] -> chat template -> tokenize -> vLLM ->
    detokenize -> [postprocess]."""
    engine_kwargs = EngineKwargs(config.engine_kwargs)
    remote_fn = None
    share = config.gpu_share()
    if config.placement_group_config and share is None:
        remote_fn = _placement_group_fn(config)
        # the replica's workers live in its placement group: vLLM places them through Ray
        engine_kwargs.setdefault("distributed_executor_backend", "ray")
    settings = vllm_settings(config, engine_kwargs)
    keep_warm_s = config.resolved_keep_warm_s()
    if keep_warm_s and (remote_fn is not None or not engine_kwargs.single_process()):
        keep_warm_s = 0.0  # a warm host serves engines of one device only (stages/warm.py)
    layout = _engine_layout(config, VLLMEngine(settings), remote_fn=remote_fn, keep_warm_s=keep_warm_s,
                            lora_base_rows_apart=config.lora_base_rows_apart, **kwargs)
    layout.ray_executor = engine_kwargs.get("distributed_executor_backend") == "ray"
    if share is not None:  # a replica takes its share of one GPU (Ray schedules it with a fractional num_gpus)
        layout.devices_per_replica = share
        bundle_cpus = config.placement_group_config["bundles"][0].get("CPU")
        if bundle_cpus is not None:
            layout.engine_resources = {"num_cpus": float(bundle_cpus)}
    return layout


@register(SGLangEngineProcessorConfig)
def build_sglang_layout(config: SGLangEngineProcessorConfig, **kwargs: Any) -> Layout:
    """The SGLang layout (GPU only): [preprocess] -> chat template -> tokenize -> SGLang ->
    [detokenize, where the engine left text out] -> [postprocess]."""
    if config.prepare_multimodal_stage.enabled:
        raise ConfigError("SGLangEngineProcessorConfig: prepare_multimodal_stage is not supported with SGLang by "
                          "this llmbatch version; use vLLMEngineProcessorConfig for images, video and audio")
    engine = SGLangEngine(SGLangSettings(model_source=config.model_source, engine_kwargs=config.engine_kwargs,
                                         task_type=config.task_type))
    return _engine_layout(config, engine, needs_gpu=True, **kwargs)


def _engine_layout(config: OfflineProcessorConfig, engine: Any, *, remote_fn=None, needs_gpu: bool = False,
                   keep_warm_s: float = 0.0, lora_base_rows_apart: bool | None = None,
                   preprocess: UserFn | None = None, postprocess: UserFn | None = None,
                   preprocess_map_kwargs: dict[str, Any] | None = None,
                   postprocess_map_kwargs: dict[str, Any] | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None) -> Layout:
    """An engine's layout: the CPU stages around ``engine``, laid out for the config."""
    engine_kwargs = EngineKwargs(config.engine_kwargs)
    trust = engine_kwargs.trust_remote_code
    generate = config.task_type == "generate"
    pre: list[StageSpec] = []
    if preprocess is not None:
        pre.append(StageSpec(PreprocessStage(preprocess), None, preprocess_map_kwargs))
    mm = config.prepare_multimodal_stage
    ct = config.chat_template_stage
    vllm_chat = None
    if mm.enabled:
        policy = MediaPolicy.for_access(
            mm.media_access, allowed_local_media_path=engine_kwargs.allowed_local_media_path,
            allowed_media_domains=engine_kwargs.allowed_media_domains, max_bytes=mm.max_item_bytes,
            timeout_s=mm.fetch_timeout_s, retries=mm.fetch_retries)
        vllm_chat = VllmChat(mm.model_source or config.model_source, engine_kwargs, mm.model_config_kwargs,
                             mm.chat_template_content_format, ct.chat_template if ct.enabled else None,
                             apply_sys_msg_formatting=bool(mm.apply_sys_msg_formatting))
        pre.append(StageSpec(PrepareMultimodalStage(vllm_chat, policy), mm))
    if ct.enabled:
        pre.append(StageSpec(ChatTemplateStage(ct.model_source or config.model_source, ct.chat_template,
                                               {**(chat_template_kwargs or {}), **(ct.chat_template_kwargs or {})},
                                               trust, vllm_chat=vllm_chat), ct))
    tk = config.tokenize_stage
    if tk.enabled:
        pre.append(StageSpec(TokenizeStage(tk.model_source or config.model_source, engine_kwargs, trust,
                                           task=config.task_type, engine_model=config.model_source), tk))
    lo, hi = config.concurrency_range()
    engine = EngineStage(
        engine,
        max_pending_requests=config.max_pending_requests,
        dedup_requests=config.dedup_requests,
        sort_by_prefix=config.sort_by_prefix,
        flush_rows=max(1, min(64, config.batch_size // 4)),
        structured_output_errors=config.resolved_structured_output_errors(),
        lora_base_rows_apart=lora_base_rows_apart,
    )
    if keep_warm_s:
        engine = WarmEngineStage(engine, keep_warm_s)
    post: list[StageSpec] = []
    dt = config.detokenize_stage
    if dt.enabled and generate:
        post.append(StageSpec(DetokenizeStage(dt.model_source or config.model_source, trust), dt))
    if postprocess is not None:
        post.append(StageSpec(PostprocessStage(postprocess), None, postprocess_map_kwargs))
    return Layout(
        pre=pre, engine=engine, post=post, batch_size=config.batch_size, concurrency=(lo, hi),
        task_type=config.task_type, continue_on_error=config.should_continue_on_error, fuse=config.fuse_stages,
        devices_per_replica=config.devices_per_replica(), accelerator_type=config.accelerator_type,
        runtime_env=config.runtime_env, max_concurrent_batches=config.resolved_max_concurrent_batches(),
        max_tasks_in_flight=config.max_tasks_in_flight_per_actor, engine_remote_args_fn=remote_fn,
        stall_timeout_s=config.stall_timeout_s, needs_gpu=needs_gpu)


def _endpoint_layout(config: EndpointProcessorConfig, engine: Any, *, preprocess: UserFn | None,
                     postprocess: UserFn | None, preprocess_map_kwargs: dict[str, Any] | None,
                     postprocess_map_kwargs: dict[str, Any] | None, stage: Any = None,
                     max_attempts: int = 3) -> Layout:
    """[preprocess] -> endpoint -> [postprocess]: no chat template, tokenizer or GPU here."""
    pre = [StageSpec(PreprocessStage(preprocess), None, preprocess_map_kwargs)] if preprocess is not None else []
    post = [StageSpec(PostprocessStage(postprocess), None, postprocess_map_kwargs)] if postprocess is not None else []
    stage_engine = EngineStage(engine, max_pending_requests=config.max_concurrent_requests,
                               dedup_requests=config.dedup_requests,
                               sort_by_prefix=False, flush_rows=max(1, min(64, config.batch_size // 4)),
                               structured_output_errors=config.resolved_structured_output_errors(),
                               max_attempts=max_attempts)
    batch_size, concurrency = config.batch_size, config.concurrency
    resources: dict[str, Any] = {}
    if stage is not None:
        batch_size = stage.batch_size or batch_size
        concurrency = stage.concurrency or concurrency
        resources = {k: v for k, v in (("num_cpus", stage.num_cpus), ("memory", stage.memory)) if v is not None}
    lo, hi = (concurrency, concurrency) if isinstance(concurrency, int) else concurrency
    return Layout(
        pre=pre, engine=stage_engine, post=post, batch_size=batch_size, concurrency=(lo, hi), task_type="endpoint",
        continue_on_error=config.should_continue_on_error, devices_per_replica=0,
        accelerator_type=config.accelerator_type, runtime_env=getattr(stage, "runtime_env", None),
        max_concurrent_batches=config.resolved_max_concurrent_batches(), stall_timeout_s=config.stall_timeout_s,
        engine_resources=resources)


def endpoint_headers(config: HttpRequestProcessorConfig) -> dict[str, Any]:
    """The request headers, with the key from ``api_key_env``; secret values are :class:`Secret`
    (shown as ``<redacted>`` anywhere they are printed or logged)."""
    headers = {k: Secret(str(v)) if is_secret_key(k) else v for k, v in (config.headers or {}).items()}
    if config.api_key_env:
        key = os.environ.get(config.api_key_env)
        if not key:
            raise ConfigError(f"api_key_env names {config.api_key_env!r}, which is not set in the environment; "
                              f"export {config.api_key_env}=... and run again")
        headers["Authorization"] = Secret(f"Bearer {key}")
    return headers


@register(HttpRequestProcessorConfig)
def build_http_layout(config: HttpRequestProcessorConfig, *, preprocess: UserFn | None = None,
                         postprocess: UserFn | None = None, preprocess_map_kwargs: dict[str, Any] | None = None,
                         postprocess_map_kwargs: dict[str, Any] | None = None) -> Layout:
    """The HTTP layout: [preprocess] -> OpenAI-compatible endpoint -> [postprocess]."""
    engine = HttpEngine(HttpSettings(
        url=config.url, headers=endpoint_headers(config), model=config.model, qps=config.qps,
        tokens_per_minute=config.tokens_per_minute, max_retries=config.max_retries,
        base_retry_wait_time_in_s=config.base_retry_wait_time_in_s,
        max_concurrent_requests=config.max_concurrent_requests, request_timeout_s=config.request_timeout_s,
        dedup_requests=config.dedup_requests, structured_output_fields=config.structured_output_fields,
        session_factory=config.session_factory))
    return _endpoint_layout(config, engine, preprocess=preprocess, postprocess=postprocess,
                            preprocess_map_kwargs=preprocess_map_kwargs, postprocess_map_kwargs=postprocess_map_kwargs,
                            stage=config.http_request_stage)


@register(ServeDeploymentProcessorConfig)
def build_serve_layout(config: ServeDeploymentProcessorConfig, *, preprocess: UserFn | None = None,
                          postprocess: UserFn | None = None, preprocess_map_kwargs: dict[str, Any] | None = None,
                          postprocess_map_kwargs: dict[str, Any] | None = None) -> Layout:
    """The Serve layout: [preprocess] -> a shared Ray Serve deployment -> [postprocess]."""
    engine = ServeEngine(ServeSettings(
        deployment_name=config.deployment_name, app_name=config.app_name, dtype_mapping=config.dtype_mapping,
        request_timeout_s=config.request_timeout_s, model=config.model,
        max_concurrent_requests=config.max_concurrent_requests, dedup_requests=config.dedup_requests,
        structured_output_fields=config.structured_output_fields))
    return _endpoint_layout(config, engine, preprocess=preprocess, postprocess=postprocess,
                            preprocess_map_kwargs=preprocess_map_kwargs, postprocess_map_kwargs=postprocess_map_kwargs,
                            max_attempts=REPLICA_ATTEMPTS)


def _placement_group_fn(config: vLLMEngineProcessorConfig) -> Callable[[], dict[str, Any]]:
    """A fresh placement group per replica (Ray's ``placement_group_config``)."""
    pg_config = dict(config.placement_group_config or {})
    n = config.devices_per_replica()
    accelerator = config.accelerator_type

    def remote_args() -> dict[str, Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if "bundles" in pg_config:
            bundles = [dict(b) for b in pg_config["bundles"]]
        else:
            bundles = [dict(pg_config["bundle_per_worker"]) for _ in range(n)]
        if accelerator:
            for b in bundles:
                b[f"accelerator_type:{accelerator}"] = 0.001
        pg = ray.util.placement_group(bundles, strategy=pg_config.get("strategy", "PACK"))
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)}

    return remote_args
