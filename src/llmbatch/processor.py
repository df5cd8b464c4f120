"""Processor and its builders: configs in, a lazy Ray Data pipeline out.

``build_processor(config, preprocess=..., postprocess=...)`` returns a :class:`Processor`;
``processor(ds)`` returns a lazy ``ray.data.Dataset``. Building has no side effects (no
``ray.init``, no downloads); calling the processor checks the cluster (Ray starts itself on a
laptop), lays the stages out as Ray Data operators and returns at once.

Operators: consecutive CPU stages with the same settings run fused in one operator (one pool
of workers, no extra hops); the engine stage is a pool of ``concurrency`` replicas.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmbatch.config import (
    HttpRequestProcessorConfig,
    ProcessorConfig,
    SGLangEngineProcessorConfig,
    StageConfig,
    vLLMEngineProcessorConfig,
)
from llmbatch.errors import ConfigError
from llmbatch.stages.base import Stage
from llmbatch.stages.runner import StageRunner

logger = logging.getLogger(__name__)

UserFn = Callable[[dict[str, Any]], dict[str, Any]]

#: CPUs a CPU-stage worker reserves unless its stage config says otherwise: none. Stage
#: workers are light; a reservation would only take the whole CPU that a read, shuffle or
#: write task of the input plan needs (a 1-CPU cluster cannot run a 1-CPU task beside a
#: 0.1-CPU actor).
DEFAULT_STAGE_NUM_CPUS = 0.0
#: Whole CPUs kept free beside the engine replicas on a cluster without GPUs: one for a task of
#: the input plan that may hold its CPU while it waits (a read that a ``limit`` no longer
#: consumes), one for the task that must run next (a shuffle, a write).
CPU_HEADROOM = 2.0

@dataclass
class Operator:
    """One Ray Data operator: stages run fused, with one pool's settings."""

    name: str
    stages: list[Stage]
    batch_size: int
    min_workers: int
    max_workers: int
    remote_args: dict[str, Any] = field(default_factory=dict)
    max_tasks_in_flight: int | None = None
    max_concurrent_calls: int = 1


@dataclass
class StageSpec:
    """A stage with the settings of the pool it runs in."""

    stage: Stage
    config: StageConfig | None = None
    remote_args: dict[str, Any] | None = None  # from preprocess_map_kwargs/postprocess_map_kwargs


class Processor:
    """A batch pipeline: preprocess -> stages -> postprocess over a Ray Dataset.

    Call it on a dataset to get the output dataset (lazy). ``list_stage_names()`` and
    ``get_stage_by_name()`` show what it runs.
    """

    def __init__(self, config: ProcessorConfig, pre: list[StageSpec], engine: Stage, post: list[StageSpec],
                 *, engine_remote_args: Callable[[], dict[str, Any]] | None = None,
                 keep_private: tuple[str, ...] = (), encoded_output: bool = False):
        self.config = config
        self.encoded_output = encoded_output
        self._pre = pre
        self._engine = engine
        self._post = post
        self._engine_remote_args = engine_remote_args
        self.keep_private = keep_private

    # -- introspection -----------------------------------------------------------------------

    @property
    def stages(self) -> list[Stage]:
        return [s.stage for s in self._pre] + [self._engine] + [s.stage for s in self._post]

    def list_stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def get_stage_by_name(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise ValueError(f"no stage named {name!r}; stages: {self.list_stage_names()}")

    # -- layout ------------------------------------------------------------------------------

    def _cpu_settings(self, spec: StageSpec) -> tuple:
        """Stages with equal settings share an operator."""
        if spec.remote_args:
            return ("map_kwargs", tuple(sorted((k, repr(v)) for k, v in spec.remote_args.items())))
        cfg = spec.config
        if cfg is None:
            return (None, None, None, None, None)
        return (cfg.batch_size, cfg.concurrency, cfg.num_cpus, cfg.memory,
                None if cfg.runtime_env is None else repr(cfg.runtime_env))

    def _cpu_operators(self, specs: list[StageSpec], label: str) -> list[Operator]:
        groups: list[list[StageSpec]] = []
        for spec in specs:
            if groups and self._cpu_settings(groups[-1][-1]) == self._cpu_settings(spec):
                groups[-1].append(spec)
            else:
                groups.append([spec])
        lo, hi = self.config.concurrency_range()
        ops = []
        for group in groups:
            cfg = next((s.config for s in group if s.config is not None), None)
            extra = next((s.remote_args for s in group if s.remote_args), None) or {}
            concurrency = (cfg.concurrency if cfg and cfg.concurrency else None) or extra.get("concurrency") or hi
            workers = (concurrency, concurrency) if isinstance(concurrency, tuple) else (1, concurrency)
            remote = {"num_cpus": DEFAULT_STAGE_NUM_CPUS}
            if cfg is not None:
                if cfg.num_cpus is not None:
                    remote["num_cpus"] = cfg.num_cpus
                if cfg.memory is not None:
                    remote["memory"] = cfg.memory
                if cfg.runtime_env is not None:
                    remote["runtime_env"] = cfg.runtime_env
            remote.update({k: v for k, v in extra.items() if k in ("num_cpus", "memory", "runtime_env", "resources")})
            batch_size = (cfg.batch_size if cfg and cfg.batch_size else None) or self.config.batch_size
            name = "+".join(s.stage.name for s in group)
            ops.append(Operator(f"{label}:{name}", [s.stage for s in group], batch_size, workers[0], workers[1], remote))
        return ops

    def _engine_operator(self, cluster: dict[str, float], cpu_reserved: float) -> Operator:
        cfg = self.config
        lo, hi = cfg.concurrency_range()
        remote: dict[str, Any] = {}
        gpus_per_replica = cfg.devices_per_replica() if isinstance(cfg, vLLMEngineProcessorConfig) else 1
        use_gpu = cluster.get("GPU", 0) > 0 and not isinstance(cfg, HttpRequestProcessorConfig)
        if use_gpu:
            remote["num_gpus"] = gpus_per_replica
            remote["num_cpus"] = 1
        else:
            remote["num_cpus"] = engine_cpu_share(cluster.get("CPU", 1), hi, cpu_reserved)
        if cfg.accelerator_type:
            remote["accelerator_type"] = cfg.accelerator_type
        runtime_env = getattr(cfg, "runtime_env", None)
        if runtime_env:
            remote["runtime_env"] = runtime_env
        max_batches = cfg.resolved_max_concurrent_batches() if hasattr(cfg, "resolved_max_concurrent_batches") else 8
        in_flight = getattr(cfg, "max_tasks_in_flight_per_actor", None) or 2 * max_batches
        if self._engine_remote_args is not None and use_gpu:
            remote["ray_remote_args_fn"] = self._engine_remote_args
            remote.pop("num_gpus", None)
        return Operator("engine", [self._engine], cfg.batch_size, lo, hi, remote, in_flight, max_batches)

    @staticmethod
    def _fusable(spec: StageSpec) -> bool:
        """A stage with no settings of its own runs inside the engine replicas."""
        if spec.remote_args:
            return False
        cfg = spec.config
        return cfg is None or all(getattr(cfg, f) is None for f in ("batch_size", "concurrency", "num_cpus",
                                                                     "memory", "runtime_env"))

    def operators(self, cluster: dict[str, float] | None = None) -> list[Operator]:
        """The Ray Data operators this processor runs, in order.

        CPU stages without settings of their own are fused into the engine operator (one hop,
        no extra workers: the replica templates and tokenizes its own rows, as vLLM's own
        front-end does); a stage config with its own batch size, concurrency or resources gets
        its own pool of workers, as in Ray.
        """
        cluster = cluster if cluster is not None else {"CPU": 2.0}
        pre, post = list(self._pre), list(self._post)
        into_engine_pre: list[StageSpec] = []
        into_engine_post: list[StageSpec] = []
        if getattr(self.config, "fuse_stages", True):
            while pre and self._fusable(pre[-1]):
                into_engine_pre.insert(0, pre.pop())
            while post and self._fusable(post[0]):
                into_engine_post.append(post.pop(0))
        pre_ops = self._cpu_operators(pre, "prepare") if pre else []
        post_ops = self._cpu_operators(post, "finish") if post else []
        reserved = sum(op.max_workers * op.remote_args.get("num_cpus", 1.0) for op in pre_ops + post_ops)
        engine = self._engine_operator(cluster, reserved)
        engine.stages = [s.stage for s in into_engine_pre] + engine.stages + [s.stage for s in into_engine_post]
        engine.name = "+".join(s.name for s in engine.stages)
        return pre_ops + [engine] + post_ops

    # -- running -----------------------------------------------------------------------------

    def __call__(self, dataset):
        import uuid

        import ray
        import ray.data

        from llmbatch.cluster import check_accelerator, ensure_ray
        from llmbatch.watchdog import watch

        ensure_ray()
        cluster = ray.cluster_resources()
        if self.config.accelerator_type:
            check_accelerator(self.config.accelerator_type, cluster)
        _check_input_columns(dataset)
        ds = ray.data.Dataset.copy(dataset, _deep_copy=True)
        ctx = ds.context
        ctx.raise_original_map_exception = True  # a RowError reaches the caller as itself
        # Replicas start while rows are read; the watchdog (not a blocking wait in Ray Data's
        # operator start-up) tells a replica that is loading its model from one that can
        # never be placed, and fails the run with the reason instead of waiting.
        ctx.wait_for_min_actors_s = -1
        ctx.execution_no_progress_timeout_s = -1  # ours (below) knows a busy engine from a stall
        run_id = uuid.uuid4().hex
        watch(ctx, run_id, self.config.stall_timeout_s)
        ops = self.operators(cluster)
        task_type = getattr(self.config, "task_type", "generate")
        include_error = bool(getattr(self.config, "should_continue_on_error", False))
        rows_per_block = None
        for i, op in enumerate(ops):
            if op.batch_size != rows_per_block:
                # One batch per block: each block is one task, so a replica works on up to
                # max_concurrent_batches batches side by side from the first rows on, and a
                # batch's answers travel on as soon as that batch is done, whatever block
                # sizes the input plan produced (one block of everything, or many tiny ones).
                ds = ds.repartition(target_num_rows_per_block=op.batch_size)
                rows_per_block = op.batch_size
            sink = i == len(ops) - 1
            remote = dict(op.remote_args)
            remote_fn = remote.pop("ray_remote_args_fn", None)
            pool = dict(size=op.min_workers) if op.min_workers == op.max_workers else dict(
                min_size=op.min_workers, max_size=op.max_workers)
            if op.max_concurrent_calls > 1:
                pool.update(max_concurrent_calls_per_actor=op.max_concurrent_calls, enable_true_multi_threading=True)
            compute = ray.data.ActorPoolStrategy(max_tasks_in_flight_per_actor=op.max_tasks_in_flight, **pool)
            kwargs = dict(
                fn_constructor_kwargs=dict(stages=op.stages, sink=sink, sink_rows=self.encoded_output, task_type=task_type,
                                           include_error_column=include_error, keep_private=self.keep_private,
                                           run_id=run_id, role=op.name),
                batch_size=op.batch_size,
                batch_format="pyarrow",
                zero_copy_batch=True,
                compute=compute,
                **remote,
            )
            if remote_fn is not None:
                kwargs["ray_remote_args_fn"] = remote_fn
            ds = ds.map_batches(StageRunner, **kwargs)
        return ds


def engine_cpu_share(cluster_cpus: float, replicas: int, cpu_reserved: float) -> float:
    """CPUs each engine replica reserves on a cluster without GPUs.

    One each when the cluster has room for the replicas, what the CPU stages reserve and
    :data:`CPU_HEADROOM` whole CPUs beside them; otherwise none. The reservation is Ray's
    bookkeeping only (vLLM on CPU uses the cores the OS gives it either way), and on a small
    cluster any reservation would leave a 1-CPU task of the input plan (a read, a shuffle, a
    write, a checkpoint filter) waiting forever.
    """
    if cluster_cpus - cpu_reserved >= replicas + CPU_HEADROOM:
        return 1.0
    return 0.0


def _check_input_columns(dataset) -> None:
    from llmbatch.codec import STATE_COLUMN
    from llmbatch.rows import PRIVATE_PREFIX, ROW_ID

    try:
        names = dataset.columns(fetch_if_missing=False) or []
    except Exception:  # noqa: BLE001 - schema unknown until it runs; checked per row then
        return
    bad = [n for n in names if n.startswith(PRIVATE_PREFIX) and n not in (ROW_ID, STATE_COLUMN)]
    if bad:
        raise ConfigError(f"input column {bad[0]!r} uses a name reserved by llmbatch ({PRIVATE_PREFIX}...); rename it")


# ---------------------------------------------------------------------------- builders

Builder = Callable[..., Processor]
_REGISTRY: dict[type, Builder] = {}


def register(config_type: type) -> Callable[[Builder], Builder]:
    """Register the builder of processors for ``config_type``."""

    def deco(fn: Builder) -> Builder:
        _REGISTRY[config_type] = fn
        return fn

    return deco


def build_processor(config: ProcessorConfig, preprocess: UserFn | None = None,
                    postprocess: UserFn | None = None, *, preprocess_map_kwargs: dict[str, Any] | None = None,
                    postprocess_map_kwargs: dict[str, Any] | None = None, builder_kwargs: dict[str, Any] | None = None,
                    **kwargs: Any) -> Processor:
    """Build a processor for ``config`` (Ray's ``build_processor``/``build_llm_processor``).

    ``preprocess(row) -> dict`` returns the request fields (``messages`` or ``prompt``,
    ``sampling_params``...); ``postprocess(row) -> dict`` returns the output row.
    """
    for cls in type(config).__mro__:
        if cls in _REGISTRY:
            extra = {**(builder_kwargs or {}), **kwargs}
            return _REGISTRY[cls](config, preprocess=preprocess, postprocess=postprocess,
                                  preprocess_map_kwargs=preprocess_map_kwargs,
                                  postprocess_map_kwargs=postprocess_map_kwargs, **extra)
    raise ConfigError(f"no processor for {type(config).__name__}; known: {', '.join(c.__name__ for c in _REGISTRY)}")


build_llm_processor = build_processor


def _engine_max_model_len(config: vLLMEngineProcessorConfig) -> int | None:
    value = config.engine_kwargs.get("max_model_len")
    return int(value) if value is not None else None


@register(vLLMEngineProcessorConfig)
def build_vllm_processor(config: vLLMEngineProcessorConfig, *, preprocess: UserFn | None = None,
                         postprocess: UserFn | None = None, preprocess_map_kwargs: dict[str, Any] | None = None,
                         postprocess_map_kwargs: dict[str, Any] | None = None,
                         chat_template_kwargs: dict[str, Any] | None = None,
                         keep_private: tuple[str, ...] = (), encoded_output: bool = False) -> Processor:
    """The vLLM processor: [preprocess] -> [multimodal] -> chat template -> tokenize -> vLLM ->
    detokenize -> [postprocess]."""
    from llmbatch.engines.vllm import VLLMEngine
    from llmbatch.stages.chat_template import ChatTemplateStage
    from llmbatch.stages.detokenize import DetokenizeStage
    from llmbatch.stages.engine import EngineStage
    from llmbatch.stages.multimodal import MediaPolicy, PrepareMultimodalStage
    from llmbatch.stages.tokenize import TokenizeStage
    from llmbatch.stages.user_fns import PostprocessStage, PreprocessStage

    keep_going = config.should_continue_on_error
    trust = bool(config.engine_kwargs.get("trust_remote_code", False))
    generate = config.task_type == "generate"
    pre: list[StageSpec] = []
    if preprocess is not None:
        pre.append(StageSpec(PreprocessStage(preprocess, keep_going), None, preprocess_map_kwargs))
    mm = config.prepare_multimodal_stage
    if mm.enabled:
        policy = MediaPolicy(config.engine_kwargs.get("allowed_local_media_path"),
                             config.engine_kwargs.get("allowed_media_domains"))
        pre.append(StageSpec(PrepareMultimodalStage(config.model_source, mm.model_config_kwargs,
                                                    mm.chat_template_content_format, keep_going, policy), mm))
    ct = config.chat_template_stage
    if ct.enabled:
        pre.append(StageSpec(ChatTemplateStage(
            ct.model_source or config.model_source, ct.chat_template,
            {**(chat_template_kwargs or {}), **(ct.chat_template_kwargs or {})}, trust, keep_going), ct))
    tk = config.tokenize_stage
    if tk.enabled:
        pre.append(StageSpec(TokenizeStage(tk.model_source or config.model_source, _engine_max_model_len(config),
                                           trust, keep_going, generate=generate), tk))
    lo, hi = config.concurrency_range()
    engine = EngineStage(
        VLLMEngine(config.model_source, config.engine_kwargs, config.task_type, config.dynamic_lora_loading_path,
                   replicas_per_node=hi, detokenize_after=config.detokenize_stage.enabled and generate),
        max_pending_requests=config.max_pending_requests,
        dedup=config.dedup_requests,
        sort_by_prefix=config.sort_by_prefix,
        flush_rows=max(1, min(64, config.batch_size // 4)),
        structured_output_errors=config.resolved_structured_output_errors(),
        continue_on_error=keep_going,
    )
    post: list[StageSpec] = []
    dt = config.detokenize_stage
    if dt.enabled and generate:
        post.append(StageSpec(DetokenizeStage(dt.model_source or config.model_source, trust, keep_going), dt))
    if postprocess is not None:
        post.append(StageSpec(PostprocessStage(postprocess, keep_going), None, postprocess_map_kwargs))
    if not post:
        post.append(StageSpec(_Passthrough(keep_going), None))
    remote_fn = None
    if config.placement_group_config:
        remote_fn = _placement_group_fn(config)
        # the replica's workers live in its placement group: vLLM places them through Ray
        engine.engine.engine_kwargs.setdefault("distributed_executor_backend", "ray")
    return Processor(config, pre, engine, post, engine_remote_args=remote_fn, keep_private=keep_private,
                     encoded_output=encoded_output)


class _Passthrough(Stage):
    """The last operator when nothing else runs after the engine: shapes the output rows."""

    name = "output"

    def process_row(self, row) -> None:
        return None


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


@register(SGLangEngineProcessorConfig)
def build_sglang_processor(config: SGLangEngineProcessorConfig, **_: Any) -> Processor:
    from llmbatch.errors import MissingDependencyError

    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise MissingDependencyError("SGLangEngineProcessorConfig", "sglang")
    raise ConfigError("the SGLang engine is not supported by this llmbatch version yet; use vLLMEngineProcessorConfig")

