#!/usr/bin/env python3
"""rows/s of llmbatch on SGLang vs plain SGLang (and llmbatch on vLLM), on one GPU.

    python bench/sglang_bench.py --model MODEL_DIR --workload unique --rows 2000 --repeat 3 \\
        --systems sglang,llmbatch-sglang,llmbatch-vllm --out $OUT/bench \\
        --path sglang=/tmp/site-sg:/tmp/site-base --path vllm=/tmp/site-vllm:/tmp/site-base

Systems, each run in a fresh process of its own (the two engines need different versions of
shared packages, so each gets its own PYTHONPATH), interleaved ``--repeat`` times (A B C A B C):

- ``sglang``: plain ``sglang.Engine.generate`` with every prompt at once (chat template applied
  with the model's tokenizer, the same sampling params in SGLang's names);
- ``llmbatch-sglang``: llmbatch's processor with ``SGLangEngineProcessorConfig`` on a Ray Dataset;
- ``llmbatch-vllm``: the same with ``vLLMEngineProcessorConfig`` (skipped when vLLM is not installed).

Every system gets the same rows (bench/workloads.py) and the same pinned engine settings
(dummy weights, 2048-token context, 0.8 of GPU memory, prefix cache on) and writes its answers to
a JSONL file. Times, the same for all: ``wall_s`` from the moment the process is launched to the
last row written (the headline: users wait for start-up too); ``steady_s`` from the first request
the engine receives to the last row written (plain SGLang: the generate call; llmbatch: the
earliest request start, its answer time minus its time in the engine). The table shows medians
and min-max; the raw JSON of every run is kept (``results.json``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

GPU_MEMORY = 0.8
CONTEXT = 2048
SGLANG_KWARGS = {"load_format": "dummy", "context_length": CONTEXT, "mem_fraction_static": GPU_MEMORY,
                 "sampling_backend": "pytorch"}
VLLM_KWARGS = {"load_format": "dummy", "max_model_len": CONTEXT, "gpu_memory_utilization": GPU_MEMORY,
               "enable_prefix_caching": True}
SYSTEMS = {"sglang": "sglang", "llmbatch-sglang": "sglang", "llmbatch-vllm": "vllm"}  # system -> engine


# -- one run, in this process ------------------------------------------------------------------------


def engine_kwargs(args, engine: str) -> dict:
    """The pinned settings, with ``--sglang-kwargs`` / ``--vllm-kwargs`` (JSON) over them (null drops one)."""
    base = SGLANG_KWARGS if engine == "sglang" else VLLM_KWARGS
    extra = json.loads(getattr(args, f"{engine}_kwargs") or "{}")
    return {k: v for k, v in {**base, **extra}.items() if v is not None}


def run_sglang(rows, args, writer) -> dict:
    import sglang
    from transformers import AutoTokenizer

    from llmbatch.engines.sglang_params import sampling_params

    imported = time.time()
    engine = sglang.Engine(model_path=args.model, log_level="error", **engine_kwargs(args, "sglang"))
    ready = time.time()
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in rows]
    params = [sampling_params(r["sampling_params"], CONTEXT)[0] for r in rows]
    first = time.time()
    outs = engine.generate(prompt=prompts, sampling_params=params)
    tokens = 0
    for r, o in zip(rows, outs):
        n = o["meta_info"]["completion_tokens"]
        tokens += n
        writer.write(json.dumps({"id": r["id"], "generated_text": o["text"], "num_generated_tokens": n}) + "\n")
    writer.close()
    end = time.time()
    engine.shutdown()
    return {"rows": len(outs), "output_tokens": tokens, "first_request": first, "end": end,
            "timeline": {"engine_imported": imported, "engine_start": imported, "engine_ready": ready,
                         "first_request": first}}


def run_llmbatch(rows, args, writer, engine: str) -> dict:
    import ray

    from llmbatch import SGLangEngineProcessorConfig, vLLMEngineProcessorConfig
    from llmbatch.rows import STATS

    # BENCH_RAY_INIT (JSON): extra ray.init arguments, e.g. {"num_gpus": 1} to try this script on a CPU
    ray.init(include_dashboard=False, logging_level="WARNING", **json.loads(os.environ.get("BENCH_RAY_INIT", "{}")))
    ray_ready = time.time()
    ray.data.DataContext.get_current().enable_progress_bars = False
    # BENCH_LLMBATCH_CONFIG (JSON): processor config fields over the defaults, e.g. {"max_concurrent_batches": 16}
    extra = json.loads(os.environ.get("BENCH_LLMBATCH_CONFIG", "{}"))
    if engine == "sglang":
        config = SGLangEngineProcessorConfig(model_source=args.model, engine_kwargs=engine_kwargs(args, "sglang"),
                                             batch_size=args.batch_size, concurrency=1, **extra)
    else:
        config = vLLMEngineProcessorConfig(model_source=args.model, engine_kwargs=engine_kwargs(args, "vllm"),
                                           batch_size=args.batch_size, concurrency=1, **extra)
    from llmbatch.builders import build_layout
    from llmbatch.processor import Processor
    from llmbatch.stages.output import OutputStage

    ds = Processor(config, build_layout(config, output=OutputStage(keep_private=(STATS,))))(ray.data.from_items(rows))
    n = tokens = 0
    starts = []
    errors = []
    in_flight = 0  # the most requests the replica had inside its engine at once
    timeline = {"ray_ready": ray_ready}  # the replica's start, from the rows' stats (earliest of each)
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        cols = batch.to_pydict()
        none = [None] * batch.num_rows
        for key in (STATS, "__inference_error__", "time_taken_llm", "num_generated_tokens", "generated_text"):
            cols.setdefault(key, none)
        for i in range(batch.num_rows):
            if cols["__inference_error__"][i]:
                errors.append(cols["__inference_error__"][i])
            stats = cols[STATS][i] or {}
            in_flight = max(in_flight, stats.get("in_flight") or 0)
            for key, name in (("process_start_at", "replica_process"), ("begin_at", "replica_begin"),
                              ("start_at", "engine_start"), ("ready_at", "engine_ready"),
                              ("first_request_at", "first_request")):
                if stats.get(key):
                    timeline[name] = min(timeline.get(name, stats[key]), stats[key])
            if stats.get("finished_at") and cols["time_taken_llm"][i] is not None:
                starts.append(stats["finished_at"] - cols["time_taken_llm"][i])
            tokens += cols["num_generated_tokens"][i] or 0
            writer.write(json.dumps({"id": cols["id"][i], "generated_text": cols["generated_text"][i],
                                     "num_generated_tokens": cols["num_generated_tokens"][i]}) + "\n")
        n += batch.num_rows
    writer.close()
    end = time.time()
    ray.shutdown()
    return {"rows": n, "output_tokens": tokens, "first_request": min(starts) if starts else None, "end": end,
            "error_rows": len(errors), "errors_sample": errors[:3], "max_in_flight": in_flight, "timeline": timeline,
            "config": extra}


def one(args) -> None:
    from workloads import WORKLOADS

    rows = WORKLOADS[args.workload](args.rows)
    out = Path(args.result)
    writer = open(out.with_suffix(".rows.jsonl"), "w")
    engine = SYSTEMS[args.one]
    # found, not imported: llmbatch's driver never imports the engine (its replica does), and an
    # import here (16 s for sglang on the H100) would count against llmbatch's whole-process time
    if importlib.util.find_spec(engine) is None:
        out.write_text(json.dumps({"skipped": f"{engine} is not installed here"}))
        os._exit(3)
    if args.one == "sglang":
        result = run_sglang(rows, args, writer)
    else:
        result = run_llmbatch(rows, args, writer, engine)
    out.write_text(json.dumps(result))
    os._exit(0)


# -- the comparison ----------------------------------------------------------------------------------


def launch(system: str, args, run_dir: Path, env_path: str) -> dict:
    result = run_dir / f"{system}.json"
    env = dict(os.environ, PYTHONPATH=":".join(p for p in (env_path, str(REPO / "src")) if p))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", system, "--result", str(result), "--model", args.model,
           "--workload", args.workload, "--rows", str(args.rows), "--batch-size", str(args.batch_size),
           "--sglang-kwargs", args.sglang_kwargs, "--vllm-kwargs", args.vllm_kwargs]
    launched = time.time()
    with open(run_dir / f"{system}.log", "w") as log:
        try:
            code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    data = json.loads(result.read_text()) if result.exists() else {}
    if data.get("skipped"):
        return {"system": system, "skipped": data["skipped"]}
    if code != 0 or "end" not in data:
        tail = (run_dir / f"{system}.log").read_text()[-1500:]
        return {"system": system, "failed": f"exit {code}", "log_tail": tail}
    wall = data["end"] - launched
    steady = data["end"] - data["first_request"] if data.get("first_request") else None
    return {"system": system, "rows": data["rows"], "output_tokens": data["output_tokens"], "wall_s": round(wall, 2),
            "steady_s": round(steady, 2) if steady else None, "rows_per_s": round(data["rows"] / wall, 2),
            "steady_rows_per_s": round(data["rows"] / steady, 2) if steady else None,
            "error_rows": data.get("error_rows", 0), "errors_sample": data.get("errors_sample", []),
            "max_in_flight": data.get("max_in_flight"), "config": data.get("config"),
            # seconds from the launch to each step (plain SGLang: its import, engine start, generate call)
            "timeline_s": {k: round(v - launched, 2) for k, v in (data.get("timeline") or {}).items()}}


def summary(runs: list[dict], systems: list[str]) -> list[dict]:
    table = []
    for s in systems:
        ok = [r for r in runs if r["system"] == s and "rows_per_s" in r]
        if not ok:
            continue
        row = {"system": s, "runs": len(ok)}
        for key in ("rows_per_s", "steady_rows_per_s"):
            vals = [r[key] for r in ok if r.get(key)]
            if vals:
                row[key] = {"median": round(statistics.median(vals), 2), "min": min(vals), "max": max(vals)}
        table.append(row)
    base = next((t for t in table if t["system"] == "sglang"), None)
    for t in table:
        for key in ("rows_per_s", "steady_rows_per_s"):
            if base and key in t and key in base:
                t[f"{key}_vs_sglang"] = round(t[key]["median"] / base[key]["median"], 3)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", default="unique")
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--systems", default="sglang,llmbatch-sglang,llmbatch-vllm")
    p.add_argument("--path", action="append", default=[], help="ENGINE=PYTHONPATH for that engine's processes")
    p.add_argument("--sglang-kwargs", default="{}", help="JSON over the pinned SGLang settings (null drops one)")
    p.add_argument("--vllm-kwargs", default="{}", help="JSON over the pinned vLLM settings (null drops one)")
    p.add_argument("--timeout", type=int, default=300, help="seconds one run may take")
    p.add_argument("--budget", type=int, default=560, help="start no run after this many seconds")
    p.add_argument("--out", default="bench-sglang-out")
    p.add_argument("--one", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return one(args)
    paths = dict(item.split("=", 1) for item in args.path)
    systems = args.systems.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs: list[dict] = []
    skipped: set[str] = set()
    meta = {"model": args.model, "workload": args.workload, "rows": args.rows, "batch_size": args.batch_size,
            "sglang_kwargs": engine_kwargs(args, "sglang"), "vllm_kwargs": engine_kwargs(args, "vllm"), "paths": paths, "started": started}
    for rep in range(args.repeat):
        for system in systems:
            if system in skipped:
                continue
            if time.time() - started > args.budget:
                meta["stopped"] = f"budget of {args.budget}s spent before repeat {rep + 1} of {system}"
                break
            run_dir = out / f"{rep + 1}-{system}"
            run_dir.mkdir(exist_ok=True)
            r = launch(system, args, run_dir, paths.get(SYSTEMS[system], ""))
            r["repeat"] = rep + 1
            runs.append(r)
            if r.get("skipped"):
                skipped.add(system)
            print(json.dumps(r)[:600], flush=True)
            (out / "results.json").write_text(json.dumps({**meta, "runs": runs, "summary": summary(runs, systems)}, indent=1))
    table = summary(runs, systems)
    (out / "results.json").write_text(json.dumps({**meta, "runs": runs, "summary": table}, indent=1))
    print("\n| system | runs | rows/s, process start to last row (median, min-max) | vs sglang "
          "| rows/s, first request to last row | vs sglang |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for t in table:
        h, s = t.get("rows_per_s", {}), t.get("steady_rows_per_s", {})
        print(f"| {t['system']} | {t['runs']} | {h.get('median')} ({h.get('min')}-{h.get('max')}) | "
              f"{t.get('rows_per_s_vs_sglang', '')} | {s.get('median')} ({s.get('min')}-{s.get('max')}) | "
              f"{t.get('steady_rows_per_s_vs_sglang', '')} |")
    for s in sorted(skipped):
        print(f"skipped {s}: " + next(r["skipped"] for r in runs if r["system"] == s))


if __name__ == "__main__":
    main()
