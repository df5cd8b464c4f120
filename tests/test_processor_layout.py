"""How a processor lays its stages out as Ray Data operators (no Ray needed)."""

from llmbatch import build_processor, vLLMEngineProcessorConfig
from llmbatch.processor import engine_cpu_share

MODEL = "smollm2-135m-instruct"


def names(ops):
    return [op.name for op in ops]


def test_default_stages_run_inside_the_engine_replicas():
    p = build_processor(vLLMEngineProcessorConfig(model_source=MODEL), preprocess=lambda r: r, postprocess=lambda r: r)
    ops = p.operators({"CPU": 2.0})
    assert names(ops) == ["preprocess+chat_template+tokenize+engine+detokenize+postprocess"]
    assert ops[0].remote_args["num_cpus"] == 0.0  # a 2-CPU machine keeps its CPUs for the input plan
    assert ops[0].max_concurrent_calls == 64 and ops[0].min_workers == ops[0].max_workers == 1
    assert ops[0].block_batches == 1  # placement.MIN_BLOCK_ROWS is off by default


def test_stage_with_own_settings_gets_its_own_workers():
    config = vLLMEngineProcessorConfig(model_source=MODEL, concurrency=2,
                                       tokenize_stage={"concurrency": 3, "num_cpus": 0.5})
    p = build_processor(config, preprocess=lambda r: r)
    ops = p.operators({"CPU": 8.0})
    assert names(ops) == ["prepare:preprocess+chat_template", "prepare:tokenize", "engine+detokenize"]
    assert ops[1].max_workers == 3 and ops[1].remote_args["num_cpus"] == 0.5
    assert ops[2].min_workers == 2


def test_a_stage_pool_given_as_a_min_max_range_autoscales_in_it():
    config = vLLMEngineProcessorConfig(model_source=MODEL, prepare_multimodal_stage={"enabled": True, "concurrency": (1, 4)})
    ops = build_processor(config, preprocess=lambda r: r, preprocess_map_kwargs={"concurrency": (2, 3)}).operators()
    assert names(ops) == ["prepare:preprocess", "prepare:prepare_multimodal", "chat_template+tokenize+engine+detokenize"]
    assert (ops[0].min_workers, ops[0].max_workers) == (2, 3) and (ops[1].min_workers, ops[1].max_workers) == (1, 4)


def test_fusion_can_be_switched_off():
    p = build_processor(vLLMEngineProcessorConfig(model_source=MODEL, fuse_stages=False), preprocess=lambda r: r)
    assert names(p.operators()) == ["prepare:preprocess+chat_template+tokenize", "engine", "finish:detokenize"]


def test_engine_never_takes_the_readers_core_on_a_small_machine():
    # a replica reserves a CPU only where two whole CPUs stay free for the input plan's tasks
    assert engine_cpu_share(1.0, 1, 0.0) == 0.0
    assert engine_cpu_share(2.0, 1, 0.0) == 0.0
    assert engine_cpu_share(3.0, 1, 0.0) == 1.0
    assert engine_cpu_share(4.0, 2, 0.5) == 0.0
    assert engine_cpu_share(64.0, 8, 1.6) == 1.0


def test_gpu_replicas_ask_for_tp_x_pp_gpus():
    config = vLLMEngineProcessorConfig(model_source=MODEL, accelerator_type="H100",
                                       engine_kwargs={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    op = build_processor(config, preprocess=lambda r: r).operators({"CPU": 64.0, "GPU": 8.0})[-1]
    assert op.remote_args["num_gpus"] == 4 and op.remote_args["accelerator_type"] == "H100"


def test_replicas_share_a_gpu_with_a_fractional_bundle():
    """Ray Serve LLM's fractional-GPU spelling: one bundle of half a GPU puts each replica's
    engine on half of one GPU (Ray's fractional num_gpus), with no placement group and no Ray
    executor; a whole-GPU bundle keeps the placement group."""
    config = vLLMEngineProcessorConfig(model_source=MODEL, concurrency=2,
                                       placement_group_config={"bundles": [{"GPU": 0.5, "CPU": 2}]},
                                       engine_kwargs={"gpu_memory_utilization": 0.45}, keep_warm_s=0)
    assert config.gpu_share() == 0.5
    processor = build_processor(config, preprocess=lambda r: r)
    op = processor.operators({"CPU": 16.0, "GPU": 1.0})[-1]
    assert op.remote_args["num_gpus"] == 0.5 and op.remote_args["num_cpus"] == 2.0, op.remote_args
    assert "ray_remote_args_fn" not in op.remote_args and op.max_workers == 2
    assert "distributed_executor_backend" not in processor.layout.engine.engine.settings.engine_kwargs
    assert not processor.layout.ray_executor
    whole = vLLMEngineProcessorConfig(model_source=MODEL, placement_group_config={"bundles": [{"GPU": 1}]})
    assert whole.gpu_share() is None
    processor = build_processor(whole, preprocess=lambda r: r)
    op = processor.operators({"CPU": 16.0, "GPU": 1.0})[-1]
    assert "ray_remote_args_fn" in op.remote_args and "num_gpus" not in op.remote_args
    assert processor.layout.ray_executor  # (a cluster without GPUs refuses it: test_processor_vllm)


def test_the_output_stage_runs_last_in_the_last_operator_and_nothing_else_carries_job_flags():
    """The job layer's output shape (private keys kept, rows typed for its driver) is its own output
    stage, passed to build_layout: the layout, the runner and the builders know no such flags."""
    import dataclasses
    import inspect

    from llmbatch.builders import build_layout
    from llmbatch.processor import Layout, Processor
    from llmbatch.stages.output import OutputStage
    from llmbatch.stages.runner import StageRunner

    config = vLLMEngineProcessorConfig(model_source=MODEL, fuse_stages=False)
    job = Processor(config, build_layout(config, preprocess=lambda r: r,
                                         output=OutputStage(keep_private=("__llmbatch_id",), for_job=True)))
    ops = job.operators()
    assert names(ops) == ["prepare:preprocess+chat_template+tokenize", "engine", "finish:detokenize"]
    assert ops[-1].stages[-1] is job.layout.output and job.layout.output.for_job
    assert not any(isinstance(s, OutputStage) for op in ops[:-1] for s in op.stages)
    assert job.layout.output.keep_private == ("__llmbatch_id",) and not job.layout.output.postprocessed
    user = build_processor(config, postprocess=lambda r: r)
    assert not user.layout.output.for_job and user.layout.output.postprocessed
    flags = {"keep_private", "encoded_output", "sink"}
    assert not flags & {f.name for f in dataclasses.fields(Layout)}
    assert not flags & set(inspect.signature(StageRunner).parameters)


def test_one_replica_takes_blocks_of_several_batches_and_works_on_as_many_batches(monkeypatch):
    from llmbatch import placement

    monkeypatch.setattr(placement, "MIN_BLOCK_ROWS", 1024)
    # a Ray Data block costs a task and its bookkeeping: one replica gets blocks of
    # MIN_BLOCK_ROWS rows that it runs as batches of batch_size side by side
    p = build_processor(vLLMEngineProcessorConfig(model_source=MODEL, batch_size=256), preprocess=lambda r: r)
    (op,) = p.operators({"CPU": 2.0})
    assert (op.batch_size, op.block_batches, op.block_rows) == (256, 4, 1024)
    assert op.max_concurrent_calls * op.block_batches == p.layout.max_concurrent_batches  # batches in flight as configured
    # a user's own max_concurrent_batches bounds a block too: half of them at most, so that a
    # replica works on two blocks (one fills the engine while the other's slowest batch drains)
    p = build_processor(vLLMEngineProcessorConfig(model_source=MODEL, batch_size=4, max_concurrent_batches=8))
    (op,) = p.operators({"CPU": 2.0})
    assert (op.block_batches, op.max_concurrent_calls) == (4, 2)
    p = build_processor(vLLMEngineProcessorConfig(model_source=MODEL, batch_size=4, max_concurrent_batches=2))
    (op,) = p.operators({"CPU": 2.0})
    assert (op.block_batches, op.max_concurrent_calls) == (1, 2)
    # blocks of one batch where they spread over several replicas (a small input reaches each)
    p = build_processor(vLLMEngineProcessorConfig(model_source=MODEL, batch_size=4, concurrency=2))
    (op,) = p.operators({"CPU": 8.0})
    assert (op.block_batches, op.max_concurrent_calls) == (1, p.layout.max_concurrent_batches)


def test_a_gpu_node_with_cpus_to_spare_prepares_rows_in_a_pool_of_their_own():
    p = build_processor(vLLMEngineProcessorConfig(model_source=MODEL, batch_size=256), preprocess=lambda r: r)
    ops = p.operators({"CPU": 16.0, "GPU": 1.0})
    assert names(ops) == ["prepare:preprocess+chat_template+tokenize", "engine+detokenize"]
    prepare, engine = ops
    # 16 CPUs: one for the replica, CPU_HEADROOM for the input plan, the rest prepare rows
    assert (prepare.min_workers, prepare.max_workers, prepare.remote_args["num_cpus"]) == (1, 13, 1.0)
    assert prepare.block_rows == engine.block_rows == 256  # no re-blocking between them
    # the dedup key stays the engine stage's: every row still reaches the engine operator
    assert [s.name for s in engine.stages] == ["engine", "detokenize", "output"]
    # a CPU machine, or a GPU node without CPUs to spare: the replicas keep them
    for cluster in ({"CPU": 2.0}, {"CPU": 64.0}, {"CPU": 4.0, "GPU": 1.0}):
        assert names(p.operators(cluster)) == ["preprocess+chat_template+tokenize+engine+detokenize"], cluster
    # one replica per GPU: fewer CPUs to spare
    p = build_processor(vLLMEngineProcessorConfig(model_source=MODEL, concurrency=8), preprocess=lambda r: r)
    assert p.operators({"CPU": 16.0, "GPU": 8.0})[0].max_workers == 6
