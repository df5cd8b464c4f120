"""The processor: a typed :class:`Layout` of stages in, a lazy Ray Data pipeline out.

Builders (:mod:`llmbatch.builders`) resolve a config once into a :class:`Layout`;
``processor(ds)`` returns a lazy ``ray.data.Dataset``. Calling the processor checks the
cluster (Ray starts itself on a laptop), lays the stages out as Ray Data operators and
returns at once.

Operators: consecutive CPU stages with the same settings run fused in one operator (one pool
of workers, no extra hops); the engine stage is a pool of ``concurrency`` replicas.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmbatch.cluster import check_accelerator, ensure_ray
from llmbatch.codec import STATE_COLUMN
from llmbatch.config import (
    ProcessorConfig,
    StageConfig,
)
from llmbatch.errors import ConfigError, ResourceError
from llmbatch.placement import (
    DEFAULT_STAGE_NUM_CPUS,
    SPREAD_WORKER_CPUS,
    block_batches,
    engine_cpu_share,
    spread_workers,
)
from llmbatch.rows import PRIVATE_PREFIX, ROW_ID
from llmbatch.stages.base import Stage
from llmbatch.stages.output import OutputStage
from llmbatch.stages.runner import StageRunner
from llmbatch.stages.warm import WarmEngineStage
from llmbatch.watchdog import watch

logger = logging.getLogger(__name__)

UserFn = Callable[[dict[str, Any]], dict[str, Any]]



@dataclass
class StageSpec:
    """A stage with the settings of the pool it runs in."""

    stage: Stage
    config: StageConfig | None = None
    remote_args: dict[str, Any] | None = None  # from preprocess_map_kwargs/postprocess_map_kwargs

    def settings(self) -> tuple:
        """Stages with equal settings share an operator."""
        if self.remote_args:
            return ("map_kwargs", tuple(sorted((k, repr(v)) for k, v in self.remote_args.items())))
        return tuple(repr(getattr(self.config, f, None)) for f in StageConfig.RESOURCE_FIELDS)

    def fusable(self) -> bool:
        """A stage with no settings of its own runs inside the engine replicas."""
        return not self.remote_args and (self.config is None or not self.config.own_resources())


#: Ray's resource names of the accelerators vLLM's Ray executor places workers on
ACCELERATORS = ("GPU", "TPU", "HPU", "NPU", "neuron_cores")


@dataclass
class Layout:
    """Everything a processor runs, resolved from its config once, by its builder."""

    pre: list[StageSpec]
    engine: Stage
    post: list[StageSpec]
    batch_size: int
    concurrency: tuple[int, int]
    task_type: str = "generate"
    continue_on_error: bool = False
    fuse: bool = True
    #: GPUs one replica takes (less than 1: replicas share a GPU, ``gpu_share``)
    devices_per_replica: float = 1
    accelerator_type: str | None = None
    runtime_env: dict[str, Any] | None = None
    max_concurrent_batches: int = 8
    max_tasks_in_flight: int | None = None
    engine_remote_args_fn: Callable[[], dict[str, Any]] | None = None
    stall_timeout_s: float | None = None
    needs_gpu: bool = False  # an engine with no CPU build (SGLang)
    #: vLLM places its workers through Ray's executor (``placement_group_config`` sets it), which
    #: vLLM's CPU build does not have
    ray_executor: bool = False
    #: the engine workers' own resources (num_cpus, memory) where a stage config sets them
    engine_resources: dict[str, Any] | None = None
    #: the last stage, in the last operator: the shape of the output rows (the public API's, or
    #: the job layer's: ``builders.build_layout``)
    output: OutputStage = field(default_factory=OutputStage)


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
    #: engine batches per Ray Data block (:data:`MIN_BLOCK_ROWS`)
    block_batches: int = 1
    #: the engine operator whose start the workers this pool adds wait out (runner.py)
    defer_to: str = ""

    @property
    def block_rows(self) -> int:
        return self.batch_size * self.block_batches



class Processor:
    """A batch pipeline: preprocess -> stages -> postprocess over a Ray Dataset.

    Call it on a dataset to get the output dataset (lazy). ``list_stage_names()`` and
    ``get_stage_by_name()`` show what it runs.
    """

    def __init__(self, config: ProcessorConfig, layout: Layout):
        self.config = config
        self.layout = layout
        self.run_id: str | None = None  # the last run's id: its replicas' heartbeats carry it

    # -- introspection -----------------------------------------------------------------------

    @property
    def stages(self) -> list[Stage]:
        lay = self.layout
        return [s.stage for s in lay.pre] + [lay.engine] + [s.stage for s in lay.post]

    def list_stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def get_stage_by_name(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise ValueError(f"no stage named {name!r}; stages: {self.list_stage_names()}")

    # -- layout ------------------------------------------------------------------------------

    def _cpu_operators(self, specs: list[StageSpec], label: str) -> list[Operator]:
        groups: list[list[StageSpec]] = []
        for spec in specs:
            if groups and groups[-1][-1].settings() == spec.settings():
                groups[-1].append(spec)
            else:
                groups.append([spec])
        ops = []
        for group in groups:
            cfg = next((s.config for s in group if s.config is not None), None)
            extra = next((s.remote_args for s in group if s.remote_args), None) or {}
            concurrency = (cfg.concurrency if cfg and cfg.concurrency else None) or extra.get("concurrency") \
                or self.layout.concurrency[1]
            workers = tuple(concurrency) if isinstance(concurrency, (tuple, list)) else (1, concurrency)
            remote = {"num_cpus": DEFAULT_STAGE_NUM_CPUS}
            if cfg is not None:
                remote.update({k: v for k, v in (("num_cpus", cfg.num_cpus), ("memory", cfg.memory),
                                                  ("runtime_env", cfg.runtime_env)) if v is not None})
            remote.update({k: v for k, v in extra.items() if k in ("num_cpus", "memory", "runtime_env", "resources")})
            batch_size = (cfg.batch_size if cfg and cfg.batch_size else None) or self.layout.batch_size
            name = "+".join(s.stage.name for s in group)
            ops.append(Operator(f"{label}:{name}", [s.stage for s in group], batch_size, workers[0], workers[1], remote,
                                block_batches=block_batches(batch_size, workers[1])))
        return ops

    def _engine_operator(self, cluster: dict[str, float], cpu_reserved: float) -> Operator:
        lay = self.layout
        lo, hi = lay.concurrency
        remote: dict[str, Any] = {}
        use_gpu = cluster.get("GPU", 0) > 0 and lay.devices_per_replica > 0
        if use_gpu:
            remote["num_gpus"] = lay.devices_per_replica
            remote["num_cpus"] = 1
        else:
            remote["num_cpus"] = engine_cpu_share(cluster.get("CPU", 1), hi, cpu_reserved)
        if lay.accelerator_type:
            remote["accelerator_type"] = lay.accelerator_type
        if lay.runtime_env:
            remote["runtime_env"] = lay.runtime_env
        if lay.engine_remote_args_fn is not None and use_gpu:
            remote["ray_remote_args_fn"] = lay.engine_remote_args_fn
            remote.pop("num_gpus", None)
        remote.update(lay.engine_resources or {})
        # a block's batches count among the max_concurrent_batches a replica works on, and a
        # replica works on two blocks at least: a block ends with its slowest batch, so one block
        # alone would leave the engine idle while it drains (rows of uneven lengths)
        per_block = min(block_batches(lay.batch_size, hi), max(1, lay.max_concurrent_batches // 2))
        calls = max(1, lay.max_concurrent_batches // per_block)
        in_flight = lay.max_tasks_in_flight or 2 * calls
        return Operator("engine", [lay.engine], lay.batch_size, lo, hi, remote, in_flight, calls, per_block)

    def operators(self, cluster: dict[str, float] | None = None) -> list[Operator]:
        """The Ray Data operators this processor runs, in order.

        CPU stages without settings of their own are fused into the engine operator (one hop,
        no extra workers: the replica templates and tokenizes its own rows, as vLLM's own
        front-end does); a stage config with its own batch size, concurrency or resources gets
        its own pool of workers, as in Ray.
        """
        cluster = cluster if cluster is not None else {"CPU": 2.0}
        pre, post = list(self.layout.pre), list(self.layout.post)
        into_engine_pre: list[StageSpec] = []
        into_engine_post: list[StageSpec] = []
        if self.layout.fuse:
            while pre and pre[-1].fusable():
                into_engine_pre.insert(0, pre.pop())
            while post and post[0].fusable():
                into_engine_post.append(post.pop(0))
        pre_ops = self._cpu_operators(pre, "prepare") if pre else []
        post_ops = self._cpu_operators(post, "finish") if post else []
        reserved = sum(op.max_workers * op.remote_args.get("num_cpus", 1.0) for op in pre_ops + post_ops)
        engine = self._engine_operator(cluster, reserved)
        spread = spread_workers(cluster, self.layout.concurrency[1], self.layout.devices_per_replica, reserved) \
            if into_engine_pre else 0
        if spread:
            # the node's free CPUs take the rows' work before the engine (a pool of workers,
            # one CPU each), so the replica's one CPU thread is left the engine's share of
            # it; the dedup key is the engine stage's, which still sees every row
            stages = [s.stage for s in into_engine_pre]
            batches = min(block_batches(self.layout.batch_size, 1), self.layout.max_concurrent_batches)
            pre_ops.append(Operator("prepare:" + "+".join(s.name for s in stages), stages, self.layout.batch_size,
                                    1, spread, {"num_cpus": SPREAD_WORKER_CPUS}, block_batches=batches))
            into_engine_pre = []
        engine.stages = [s.stage for s in into_engine_pre] + engine.stages + [s.stage for s in into_engine_post]
        engine.name = "+".join(s.name for s in engine.stages)
        if spread:
            pre_ops[-1].defer_to = engine.name
        ops = pre_ops + [engine] + post_ops
        ops[-1].stages.append(self.layout.output)
        return ops

    # -- running -----------------------------------------------------------------------------

    def __call__(self, dataset):
        import ray
        import ray.data

        lay = self.layout
        ensure_ray()
        cluster = ray.cluster_resources()
        if lay.accelerator_type:
            check_accelerator(lay.accelerator_type, cluster)
        if lay.needs_gpu and not cluster.get("GPU"):
            raise ResourceError(f"{type(self.config).__name__} needs a GPU and this Ray cluster has none; "
                                "run it on a GPU machine or cluster, or use vLLMEngineProcessorConfig here")
        if lay.ray_executor and not any(cluster.get(name) for name in ACCELERATORS):
            raise ConfigError("engine_kwargs.distributed_executor_backend is 'ray' (placement_group_config sets it: "
                              "vLLM then places its workers through Ray), which vLLM's CPU build does not have, and "
                              "this Ray cluster has no GPU: on a machine without GPUs leave placement_group_config "
                              "and distributed_executor_backend out (each replica runs its engine in a process of "
                              "its own)")
        _check_input_columns(dataset)
        ops = self.operators(cluster)
        if isinstance(lay.engine, WarmEngineStage):
            # the warm host runs the replica's fused stages and holds its devices; the replica
            # reads its batches and shapes its output
            warm = lay.engine
            engine_op = next(op for op in ops if warm in op.stages)
            warm.chain = [warm.local if s is warm else s for s in engine_op.stages if s is not lay.output]
            engine_op.stages = [warm] + [s for s in engine_op.stages if s is lay.output]
            warm.host_resources = {k: engine_op.remote_args.pop(k) for k in ("num_gpus", "accelerator_type")
                                   if k in engine_op.remote_args}
            if lay.runtime_env:
                warm.host_resources["runtime_env"] = lay.runtime_env
        for stage in self.stages:
            stage.prepare()
        ds = ray.data.Dataset.copy(dataset, _deep_copy=True)
        ctx = ds.context  # this dataset's own copy: nothing global changes
        ctx.raise_original_map_exception = True  # a RowError reaches the caller as itself
        # Replicas start while rows are read; the watchdog (not a blocking wait in Ray Data's
        # operator start-up) tells a replica that is loading its model from one that can
        # never be placed, and fails the run with the reason instead of waiting.
        ctx.wait_for_min_actors_s = -1
        ctx.execution_no_progress_timeout_s = -1  # ours (below) knows a busy engine from a stall
        run_id = self.run_id = uuid.uuid4().hex  # a job's live view reads the start-up phase from its heartbeats
        if isinstance(lay.engine, WarmEngineStage):
            lay.engine.run = run_id  # (its replicas never take each other's warm host)
        watch(ctx, run_id, lay.stall_timeout_s)
        if _joins_datasets(ds):
            # a union of a pandas-backed dataset (from_pandas, a pandas map_batches) and an Arrow
            # one hands the batcher slices of both formats in one bundle, which Ray Data cannot
            # combine (AssertionError in its block builder): every block becomes Arrow first
            ds = ds.map_batches(_same_table, batch_format="pyarrow", batch_size=None, zero_copy_batch=True)
        rows_per_block = None
        for i, op in enumerate(ops):
            if op.block_rows != rows_per_block:
                # Blocks of whole batches (one, or several where one worker takes them all:
                # MIN_BLOCK_ROWS): each block is one task, so a replica works on up to
                # max_concurrent_batches batches side by side from the first rows on, and a
                # batch's answers travel on as soon as that batch is done, whatever block
                # sizes the input plan produced (one block of everything, or many tiny ones).
                ds = ds.repartition(target_num_rows_per_block=op.block_rows)
                rows_per_block = op.block_rows
            ds = ds.map_batches(StageRunner, **self._map_kwargs(op, run_id))
        return ds

    def _map_kwargs(self, op: Operator, run_id: str) -> dict[str, Any]:
        import ray.data

        lay = self.layout
        remote = dict(op.remote_args)
        remote_fn = remote.pop("ray_remote_args_fn", None)
        pool = dict(size=op.min_workers) if op.min_workers == op.max_workers else dict(
            min_size=op.min_workers, max_size=op.max_workers)
        if op.max_concurrent_calls > 1:
            pool.update(max_concurrent_calls_per_actor=op.max_concurrent_calls, enable_true_multi_threading=True)
        kwargs = dict(
            fn_constructor_kwargs=dict(stages=op.stages, continue_on_error=lay.continue_on_error, run_id=run_id,
                                       role=op.name, peers=op.min_workers, peer_wait_s=lay.stall_timeout_s or 600.0,
                                       batch_rows=op.batch_size if op.block_batches > 1 else 0,
                                       freeze_heap=True,  # the worker's start-up heap (runner.py)
                                       defer_to=op.defer_to),
            batch_size=op.block_rows,
            batch_format="pyarrow",
            zero_copy_batch=True,
            compute=ray.data.ActorPoolStrategy(max_tasks_in_flight_per_actor=op.max_tasks_in_flight, **pool),
            **remote,
        )
        if remote_fn is not None:
            kwargs["ray_remote_args_fn"] = remote_fn
        return kwargs


def _joins_datasets(ds) -> bool:
    """Whether the dataset's plan has a union, whose inputs' blocks may differ in format."""
    from ray.data._internal.logical.operators.n_ary_operator import Union

    todo = [ds._logical_plan.dag]
    while todo:
        op = todo.pop()
        if isinstance(op, Union):
            return True
        todo.extend(op.input_dependencies)
    return False


def _same_table(table):
    return table


def _check_input_columns(dataset) -> None:
    try:
        names = dataset.columns(fetch_if_missing=False) or []
    except Exception:  # noqa: BLE001 - schema unknown until it runs; checked per row then
        return
    bad = [n for n in names if n.startswith(PRIVATE_PREFIX) and n not in (ROW_ID, STATE_COLUMN)]
    if bad:
        raise ConfigError(f"input column {bad[0]!r} uses a name reserved by llmbatch ({PRIVATE_PREFIX}...); rename it")
