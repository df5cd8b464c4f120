"""How a job treats a change of a setting between runs: the ``resume`` metadata of config fields.

Config fields carry it (``json_schema_extra=PLACEMENT``...); the job layer reads it
(:mod:`llmbatch.jobs.identity`) to decide whether a job resumes across a changed setting.
"""

from __future__ import annotations

#: How a job treats a change of a setting between runs (``resume`` metadata on config fields,
#: read by the job layer): "placement" never changes an answer and changes silently;
#: "numerics" changes no request but can change a greedy answer in a near-tie (batching,
#: parallelism, kernels), so it changes with a warning recorded in job.json; a field without
#: the metadata decides answers, and a job refuses to resume across it.
PLACEMENT = {"resume": "placement"}
NUMERICS = {"resume": "numerics"}
#: The same for keys of ``engine_kwargs`` (passed to vLLM as is, so not fields of ours).
ENGINE_KWARGS_RESUME: dict[str, str] = {
    **dict.fromkeys(("disable_log_stats", "enable_log_requests", "distributed_executor_backend"), "placement"),
    **dict.fromkeys(("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory_bytes",
                     "enforce_eager", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "swap_space", "enable_prefix_caching", "enable_chunked_prefill", "compilation_config",
                     "block_size", "cpu_offload_gb"), "numerics"),
}


def resume_kind(cls: type, name: str) -> str | None:
    """A config field's ``resume`` metadata ("placement", "numerics"), or None."""
    field = cls.model_fields.get(name)
    extra = field.json_schema_extra if field is not None else None
    return extra.get("resume") if isinstance(extra, dict) else None
