"""Run one workload through one system in this process and print a JSON result line.

Systems: ``vllm`` (plain ``vllm.LLM.chat`` with every prompt at once: the engine's own best),
``llmbatch`` (the processor API on a Ray Dataset), ``llmbatch-job`` (the job CLI's Python API
on a JSONL file) and ``ray`` (Ray's ``ray.data.llm``). All get the same requests and the same
engine settings. Times: ``wall_s`` includes start-up; ``steady_s`` runs from the moment the
engine was ready to the last row (the engine's start is the same cost for everyone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import WORKLOADS  # noqa: E402

GiB = 1 << 30


def engine_kwargs(args) -> dict:
    kw = {"max_model_len": args.max_model_len, "enable_prefix_caching": True}
    if args.device == "cpu":
        kw.update(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_gib * GiB)
    else:
        kw.update(gpu_memory_utilization=args.gpu_memory_utilization)
    if args.load_format:
        kw["load_format"] = args.load_format
    return kw


def run_vllm(rows, model_path, args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    t0 = time.perf_counter()
    llm = LLM(model_path, **engine_kwargs(args))
    ready = time.perf_counter()
    params = []
    for r in rows:
        sp = dict(r["sampling_params"])
        so = sp.pop("structured_outputs", None)
        params.append(SamplingParams(**sp, structured_outputs=StructuredOutputsParams(**so) if so else None))
    outs = llm.chat([r["messages"] for r in rows], params, use_tqdm=False)
    end = time.perf_counter()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    llm.llm_engine.engine_core.shutdown()  # stop the engine's processes before this one exits
    return {"rows": len(outs), "output_tokens": out_tokens, "input_tokens": in_tokens, "wall_s": end - t0,
            "steady_s": end - ready, "first_result_s": end - t0, "texts": {r["id"]: o.outputs[0].text for r, o in zip(rows, outs)}}


def run_llmbatch(rows, model_path, args) -> dict:
    import ray

    from llmbatch import build_processor, vLLMEngineProcessorConfig

    t0 = time.perf_counter()
    ray.init(include_dashboard=False, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = vLLMEngineProcessorConfig(model_source=model_path, engine_kwargs=engine_kwargs(args),
                                       batch_size=args.batch_size, concurrency=args.concurrency,
                                       dedup_requests=not args.no_dedup, sort_by_prefix=not args.no_sort)
    from llmbatch.rows import STATS

    result = _collect(build_processor(config, keep_private=(STATS,))(ray.data.from_items(rows)), t0)
    ray.shutdown()
    return result


def _collect(ds, t0: float) -> dict:
    """Drain a Ray Dataset of answered rows; steady time starts at the earliest request start
    (arrival minus time in the engine), the same estimate for every Ray-based system."""
    first = None
    out_tokens = in_tokens = n = 0
    starts = []
    texts = {}
    deduped = cached = 0
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        if "__llmbatch_stats" in batch.column_names:
            for st in batch.column("__llmbatch_stats").to_pylist():
                deduped += bool(st and st["deduped"])
                cached += (st or {}).get("cached_tokens") or 0
        now = time.perf_counter()
        first = first or now
        n += batch.num_rows
        gen = batch.column("num_generated_tokens").to_pylist()
        out_tokens += sum(gen)
        in_tokens += sum(batch.column("num_input_tokens").to_pylist())
        starts.extend(now - t for t in batch.column("time_taken_llm").to_pylist())
        texts.update(zip(batch.column("id").to_pylist(), batch.column("generated_text").to_pylist()))
    end = time.perf_counter()
    result = {"rows": n, "output_tokens": out_tokens, "input_tokens": in_tokens, "wall_s": end - t0,
              "steady_s": end - min(starts) if starts else end - t0, "first_result_s": (first or end) - t0,
              "texts": texts}
    if deduped or cached:
        result.update(dedup_ratio=round(deduped / max(1, n), 3), prefix_cache_hit_rate=round(cached / max(1, in_tokens), 3))
    return result


def run_ray(rows, model_path, args) -> dict:
    """Ray's own ray.data.llm, with the four changes it needs on a CPU machine
    (../shared/notes/ray-data-llm-on-cpu.md): a logical GPU, small CPU shares for its stages,
    no engine metrics, and vLLM's CPU settings."""
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    t0 = time.perf_counter()
    if args.device == "cpu":
        ray.init(num_gpus=1, num_cpus=8, include_dashboard=False, logging_level="WARNING")
        stage = dict(num_cpus=0.2)
    else:
        ray.init(include_dashboard=False, logging_level="WARNING")
        stage = {}
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = vLLMEngineProcessorConfig(
        model_source=model_path, engine_kwargs=engine_kwargs(args), batch_size=args.batch_size,
        concurrency=args.concurrency, chat_template_stage=dict(stage), tokenize_stage=dict(stage),
        detokenize_stage=dict(stage), log_engine_metrics=False)
    processor = build_processor(
        config,
        preprocess=lambda r: dict(messages=r["messages"], sampling_params=r["sampling_params"]),
        postprocess=lambda r: dict(id=r["id"], generated_text=r["generated_text"],
                                   num_generated_tokens=r["num_generated_tokens"],
                                   num_input_tokens=r["num_input_tokens"], time_taken_llm=r["time_taken_llm"]))
    result = _collect(processor(ray.data.from_items(rows)), t0)
    ray.shutdown()
    return result


def run_llmbatch_job(rows, model_path, args) -> dict:
    """The job CLI's Python API on a JSONL file of the same requests (messages_column)."""
    import tempfile

    from llmbatch import load_job, run_job

    tmp = Path(tempfile.mkdtemp(prefix="llmbatch-bench-job-"))
    with open(tmp / "in.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps({"id": r["id"], "messages": r["messages"], "sp": r["sampling_params"]}) + "\n")
    hooks = tmp / "bench_hooks.py"
    hooks.write_text("def request(row):\n    return {'messages': row['messages'], 'sampling_params': row['sp']}\n")
    spec = load_job(data={
        "input": {"path": str(tmp / "in.jsonl"), "id_column": "id"},
        "model": {"source": model_path, "engine_kwargs": engine_kwargs(args), "batch_size": args.batch_size,
                  "concurrency": args.concurrency, "dedup_requests": not args.no_dedup,
                  "sort_by_prefix": not args.no_sort},
        "preprocess": "bench_hooks:request", "python_path": [str(tmp)],
        "output": {"path": str(tmp / "out.parquet"), "columns": ["id", "generated_text", "num_generated_tokens"]},
    })
    t0 = time.perf_counter()
    result = run_job(spec, quiet=True)
    end = time.perf_counter()
    import pyarrow.parquet as pq

    table = pq.read_table(result.output_path)
    stats = result.stats
    steady = stats.get("steady_s") or end - t0
    return {"rows": table.num_rows, "output_tokens": stats["delivered_tokens"],
            "generated_tokens": stats["generated_tokens"], "input_tokens": stats["input_tokens"],
            "wall_s": end - t0, "steady_s": steady, "first_result_s": end - t0 - steady,
            "texts": dict(zip(table.column("id").to_pylist(), table.column("generated_text").to_pylist())),
            "dedup_ratio": stats["dedup_ratio"], "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"]}


SYSTEMS = {"vllm": run_vllm, "llmbatch": run_llmbatch, "ray": run_ray, "llmbatch-job": run_llmbatch_job}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="unique")
    p.add_argument("--rows", type=int, default=500)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--load-format", default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--no-dedup", action="store_true")
    p.add_argument("--no-sort", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from llmbatch.models import resolve_model

    model_path = resolve_model(args.model)
    rows = WORKLOADS[args.workload](args.rows)
    result = SYSTEMS[args.system](rows, model_path, args)
    result.update(system=args.system, workload=args.workload)
    Path(args.out).write_text(json.dumps(result))
    os._exit(0)


if __name__ == "__main__":
    main()
