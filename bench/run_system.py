"""Run one workload through one system in this process and write a JSON result.

Systems: ``vllm`` (plain ``vllm.LLM.chat`` with every prompt at once: the engine's own best),
``llmbatch`` (the processor API on a Ray Dataset), ``llmbatch-job`` (the job CLI's Python API
on a JSONL file), ``llmbatch-cli`` (the same job as ``llmbatch run`` in its own process) and ``ray`` (Ray's ``ray.data.llm``). All get the same requests and the same
pinned engine settings (``max_num_seqs``, ``max_num_batched_tokens`` and the rest, so that no
system runs on its own defaults), and every system writes its answers to a Parquet file.

Times, the same for every system, in epoch seconds: ``process_start`` (this process's start,
from the OS), ``first_request_at`` (the first request handed to an engine: vLLM's
``add_request``, llmbatch's replicas' own record; for ray.data.llm, which records none, the
earliest "answer time minus time in the engine", labelled ``first_request_estimated``) and
``last_row_at`` (the answers' file closed). ``wall_s`` = last row written - process start (what
a user waits for, the headline); ``engine_window_s`` = last row written - first request.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil

PROCESS_START = psutil.Process().create_time()

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import WORKLOADS  # noqa: E402

GiB = 1 << 30


def engine_kwargs(args) -> dict:
    kw = {"max_model_len": args.max_model_len, "enable_prefix_caching": True, "max_num_seqs": args.max_num_seqs,
          "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.device == "cpu":
        kw.update(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_gib * GiB)
        if args.dtype and args.dtype != "auto":  # throughput.py's one choice for every system
            kw["dtype"] = args.dtype
    else:
        kw.update(gpu_memory_utilization=args.gpu_memory_utilization)
    if args.load_format:
        kw["load_format"] = args.load_format
    if args.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = args.tensor_parallel_size
    return kw


def run_vllm(rows, model_path, args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model_path, **engine_kwargs(args))
    ready = time.time()
    first = []
    add_request = llm.llm_engine.add_request

    def noted(*a, **kw):  # the first request handed to the engine (prompt rendering comes before)
        if not first:
            first.append(time.time())
        return add_request(*a, **kw)

    llm.llm_engine.add_request = noted
    params = []
    for r in rows:
        sp = dict(r["sampling_params"])
        so = sp.pop("structured_outputs", None)
        params.append(SamplingParams(**sp, structured_outputs=StructuredOutputsParams(**so) if so else None))
    outs = llm.chat([r["messages"] for r in rows], params, use_tqdm=False)
    texts = {r["id"]: o.outputs[0].text for r, o in zip(rows, outs)}
    gen = [len(o.outputs[0].token_ids) for o in outs]
    _write(args.out_parquet, list(texts), list(texts.values()), gen)
    end = time.time()
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    llm.llm_engine.engine_core.shutdown()  # stop the engine's processes before this one exits
    return {"rows": len(outs), "output_tokens": sum(gen), "generated_tokens": sum(gen), "input_tokens": in_tokens,
            "engine_ready_at": ready, "first_request_at": first[0] if first else ready,
            "first_row_at": end, "last_row_at": end, "texts": texts}


def _write(path: str, ids: list, texts: list, gen: list) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ids, "generated_text": texts, "num_generated_tokens": gen}), path)


def run_llmbatch(rows, model_path, args) -> dict:
    import ray

    from llmbatch import vLLMEngineProcessorConfig

    ray.init(include_dashboard=False, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = vLLMEngineProcessorConfig(model_source=model_path, engine_kwargs=engine_kwargs(args),
                                       batch_size=args.batch_size, concurrency=args.concurrency,
                                       dedup_requests=not args.no_dedup, sort_by_prefix=not args.no_sort)
    from llmbatch.rows import STATS

    try:
        from llmbatch.builders import build_layout
        from llmbatch.processor import Processor
        from llmbatch.stages.output import OutputStage

        processor = Processor(config, build_layout(config, output=OutputStage(keep_private=(STATS,))))
    except ImportError:  # an older llmbatch tree (throughput.py's NAME@TAG systems)
        from llmbatch import build_processor

        processor = build_processor(config, keep_private=(STATS,))
    result = _collect(processor(ray.data.from_items(rows)), args.out_parquet)
    ray.shutdown()
    return result


def _collect(ds, path: str) -> dict:
    """Drain a Ray Dataset of answered rows into a Parquet file. llmbatch's rows carry their
    replica's first request time; for others it is estimated as the earliest "arrival minus
    time in the engine"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = None
    out_tokens = generated = in_tokens = n = 0
    starts, noted, ready = [], [], []
    replicas: dict[str, dict] = {}
    texts = {}
    deduped = cached = 0
    writer = None
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        now = time.time()
        gen = batch.column("num_generated_tokens").to_pylist()
        copied = [False] * batch.num_rows
        if "__llmbatch_stats" in batch.column_names:
            stats = batch.column("__llmbatch_stats").to_pylist()
            copied = [bool(st and st["deduped"]) for st in stats]
            cached += sum((st or {}).get("cached_tokens") or 0 for st in stats)
            noted += [st["first_request_at"] for st in stats if st and st.get("first_request_at")]
            ready += [st["ready_at"] for st in stats if st and st.get("ready_at")]
            for st in stats:
                if st and st.get("replica"):
                    _replica_row(replicas, st)
        deduped += sum(copied)
        first = first or now
        n += batch.num_rows
        out_tokens += sum(gen)
        generated += sum(g for g, c in zip(gen, copied) if not c)
        in_tokens += sum(batch.column("num_input_tokens").to_pylist())
        starts.extend(now - t for t in batch.column("time_taken_llm").to_pylist())
        ids, answers = batch.column("id").to_pylist(), batch.column("generated_text").to_pylist()
        texts.update(zip(ids, answers))
        table = pa.table({"id": ids, "generated_text": answers, "num_generated_tokens": gen})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    if writer is not None:
        writer.close()
    end = time.time()
    result = {"rows": n, "output_tokens": out_tokens, "generated_tokens": generated, "input_tokens": in_tokens,
              "first_request_at": min(noted) if noted else (min(starts) if starts else end),
              "first_request_estimated": not noted, "engine_ready_at": min(ready) if ready else None,
              "first_row_at": first or end, "last_row_at": end, "texts": texts}
    if replicas:
        result["replicas"] = {name: _per_second(rep) for name, rep in replicas.items()}
    if deduped or cached:
        result.update(dedup_ratio=round(deduped / max(1, n), 3), prefix_cache_hit_rate=round(cached / max(1, in_tokens), 3))
    return result


def _replica_row(replicas: dict, st: dict) -> None:
    """One answered row in its replica's record: its start-up times, rows, last answer and a
    sample of its requests in flight when each row finished (the replica's fill over time)."""
    rep = replicas.setdefault(st["replica"], {
        "devices": st.get("devices", ""), "start_at": st["start_at"], "ready_at": st["ready_at"],
        "first_request_at": st["first_request_at"], "rows": 0, "last_finished_at": 0.0, "finished": []})
    rep["rows"] += 1
    rep["last_finished_at"] = max(rep["last_finished_at"], st["finished_at"])
    rep["finished"].append((round(st["finished_at"], 3), st.get("in_flight")))


def _per_second(rep: dict) -> dict:
    """A replica's answers as a timeline: rows answered in each second since the process start,
    and the mean of its requests in flight as they finished."""
    counts: dict[int, list] = {}
    for at, in_flight in rep.pop("finished"):
        second = counts.setdefault(int(at - PROCESS_START), [0, 0])
        second[0] += 1
        second[1] += in_flight or 0
    first, last = min(counts), max(counts)
    rep["timeline_from_s"] = first
    rep["rows_per_s"] = [counts.get(t, [0, 0])[0] for t in range(first, last + 1)]
    rep["in_flight"] = [round(counts[t][1] / counts[t][0]) if t in counts else None for t in range(first, last + 1)]
    return rep


def run_ray(rows, model_path, args) -> dict:
    """Ray's own ray.data.llm, with the four changes it needs on a CPU machine
    (../shared/notes/ray-data-llm-on-cpu.md): a logical GPU, small CPU shares for its stages,
    no engine metrics, and vLLM's CPU settings."""
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

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
    result = _collect(processor(ray.data.from_items(rows)), args.out_parquet)
    ray.shutdown()
    return result


def _job_data(rows, model_path, args, prefix: str) -> tuple[Path, dict]:
    """A folder with the requests as JSONL and the hooks, and the job (a job file's fields) on them."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    with open(tmp / "in.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps({"id": r["id"], "messages": r["messages"], "sp": r["sampling_params"]}) + "\n")
    (tmp / "bench_hooks.py").write_text("def request(row):\n    return {'messages': row['messages'], "
                                         "'sampling_params': row['sp']}\n")
    return tmp, {
        "input": {"path": str(tmp / "in.jsonl"), "id_column": "id"},
        "model": {"source": model_path, "engine_kwargs": engine_kwargs(args), "batch_size": args.batch_size,
                  "concurrency": args.concurrency, "dedup_requests": not args.no_dedup,
                  "sort_by_prefix": not args.no_sort},
        "preprocess": "bench_hooks:request", "python_path": [str(tmp)],
        "output": {"path": args.out_parquet, "columns": ["id", "generated_text", "num_generated_tokens"]},
    }


def _job_result(stats: dict, output_path: str, end: float) -> dict:
    import pyarrow.parquet as pq

    table = pq.read_table(output_path)
    return {"rows": table.num_rows, "output_tokens": stats["delivered_tokens"],
            "generated_tokens": stats["generated_tokens"], "input_tokens": stats["input_tokens"],
            "first_request_at": stats.get("first_request_at") or end, "first_row_at": None, "last_row_at": end,
            "phases_s": stats.get("phases_s"),
            "texts": dict(zip(table.column("id").to_pylist(), table.column("generated_text").to_pylist())),
            "dedup_ratio": stats["dedup_ratio"], "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"]}


def run_llmbatch_job(rows, model_path, args) -> dict:
    """The job CLI's Python API on a JSONL file of the same requests (messages_column)."""
    from llmbatch import load_job, run_job

    _, data = _job_data(rows, model_path, args, "llmbatch-bench-job-")
    result = run_job(load_job(data=data), quiet=True)
    end = time.time()  # the output is written (and fsynced) when run_job returns
    return _job_result(result.stats, result.output_path, end)


def run_llmbatch_cli(rows, model_path, args) -> dict:
    """The job as a user runs it from a shell: ``llmbatch run job.yaml`` in a process of its own,
    started by this one (whose start the wall counts from, as for every system), on the JSONL
    and hooks of ``llmbatch-job``. The CLI starts the engine's launcher before its own imports
    where the engine is launched early (``engines/vllm_early.py``, ``prewarm``)."""
    import subprocess

    tmp, data = _job_data(rows, model_path, args, "llmbatch-bench-cli-")
    (tmp / "job.yaml").write_text(json.dumps(data))
    subprocess.run([sys.executable, "-m", "llmbatch", "run", str(tmp / "job.yaml"), "--quiet"], check=True, cwd=tmp)
    end = time.time()  # the CLI exits once the output is written (and fsynced)
    stats = json.loads((Path(args.out_parquet + ".job") / "stats.json").read_text())  # (the default job dir)
    return _job_result(stats, stats["output"], end)


SYSTEMS = {"vllm": run_vllm, "llmbatch": run_llmbatch, "ray": run_ray, "llmbatch-job": run_llmbatch_job,
           "llmbatch-cli": run_llmbatch_cli}


class GpuSampler:
    """Every GPU's utilisation and memory every 0.5 s from ``nvidia-smi``, each sample stamped
    with this machine's epoch time: ``[[t, gpu index, util %, memory MiB], ...]``."""

    def __init__(self) -> None:
        import subprocess
        import threading

        self.samples: list[list[float]] = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
             "-lms", "500"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and all(p.replace(".", "").isdigit() for p in parts):
                self.samples.append([round(time.time(), 2), int(parts[0]), float(parts[1]), float(parts[2])])

    def stop(self) -> list[list[float]]:
        self.proc.terminate()
        self.thread.join(timeout=5)
        return self.samples


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
    p.add_argument("--dtype", default=None, help="the engine's dtype on a CPU (unset or 'auto': vLLM's); "
                   "throughput.py pins one for every system")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--no-dedup", action="store_true")
    p.add_argument("--no-sort", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--label", default="", help="this configuration's name in scaling reports")
    p.add_argument("--gpu-util", action="store_true", help="sample every GPU's utilisation (nvidia-smi) into the JSON")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.out_parquet = str(Path(args.out).with_suffix(".parquet"))
    from llmbatch.models import resolve_model

    model_path = resolve_model(args.model)
    rows = WORKLOADS[args.workload](args.rows)
    sampler = GpuSampler() if args.gpu_util else None
    result = SYSTEMS[args.system](rows, model_path, args)
    if sampler is not None:
        result["gpu_util"] = sampler.stop()
    result.update(system=args.system, workload=args.workload, process_start=PROCESS_START,
                  wall_s=result["last_row_at"] - PROCESS_START,
                  engine_window_s=result["last_row_at"] - result["first_request_at"],
                  engine_kwargs=engine_kwargs(args), batch_size=args.batch_size, concurrency=args.concurrency,
                  label=args.label or f"{args.system} x{args.concurrency}"
                  + (f" tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""))
    Path(args.out).write_text(json.dumps(result))
    os._exit(0)


if __name__ == "__main__":
    main()
