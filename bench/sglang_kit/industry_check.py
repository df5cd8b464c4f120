#!/usr/bin/env python3
"""The seeds' industry flow (examples/industry.yaml) as a job on SGLang, on the GPU machine.

    python bench/sglang_kit/industry_check.py --model MODEL_DIR --rows 3000 --out $OUT/flow
    python bench/sglang_kit/industry_check.py --model MODEL_DIR --rows 20000 --out $OUT/kill --kill-after-rows 3000 --no-dedup

Checks, and writes ``check.json`` with the figures: every input row is in the output exactly
once, no error row, every answer is one of the job's choices (SGLang's constrained decoding;
with random weights only the constraint makes the answer a label). With ``--kill-after-rows``
a thread SIGKILLs the SGLang scheduler (the engine's GPU process) once that many rows were
answered; the replica must restart its engine and retry the rows it had in flight. After the
run (Ray shut down): no process of the run holds the GPU (``nvidia-smi``) and no SGLang
process is left. Exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Over the job file's own engine_kwargs ({max_model_len: 512}, vLLM's name, which llmbatch maps
#: to SGLang's context_length): vLLM's names again where they exist, SGLang's where not.
SGLANG_KWARGS = {"load_format": "dummy", "gpu_memory_utilization": 0.8, "sampling_backend": "pytorch"}


def sglang_processes() -> list[tuple[int, str]]:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            text = " ".join([proc.info["name"] or ""] + (proc.info["cmdline"] or []))
        except psutil.Error:
            continue
        if "sglang::" in text and proc.pid != os.getpid():
            found.append((proc.pid, text[:120]))
    return found


def gpu_processes() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"nvidia-smi failed: {exc}"]
    return [line for line in out.splitlines() if line.strip()]


def killer(job_dir: Path, after_rows: int, log: list) -> None:
    """SIGKILL the SGLang scheduler once ``after_rows`` rows are committed (or 60 s after it is up)."""
    from llmbatch.jobs.status import job_status

    seen_up = None
    while True:
        time.sleep(0.2)
        procs = [p for p in sglang_processes() if "scheduler" in p[1]]
        if procs and seen_up is None:
            seen_up = time.time()
        try:
            done = job_status(job_dir).get("rows_done", 0) if job_dir.exists() else 0
        except Exception:  # noqa: BLE001 - status before the first commit
            done = 0
        if procs and (done >= after_rows or time.time() - seen_up > 60):
            for pid, text in procs:
                os.kill(pid, signal.SIGKILL)
                log.append({"killed": pid, "what": text, "rows_done": done, "at": time.time()})
            return


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-after-rows", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--no-dedup", action="store_true", help="send every row to the engine (the kill run: real work in flight)")
    p.add_argument("--sglang-kwargs", default=os.environ.get("SGLANG_KWARGS_JSON", "{}"),
                   help="JSON over the SGLang settings (null drops one), e.g. '{\"attention_backend\": \"triton\"}'")
    args = p.parse_args()
    from llmbatch import load_job, run_job
    from llmbatch.sample_data import write_customers_csv

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv = write_customers_csv(out / "customers.csv", args.rows)
    spec = load_job(REPO / "examples" / "industry.yaml", data={
        "input": {"path": str(csv)},
        "model": {"source": args.model, "processor": "sglang", "engine_kwargs": {
            k: v for k, v in {**SGLANG_KWARGS, **json.loads(args.sglang_kwargs)}.items() if v is not None},
                  "batch_size": args.batch_size, "dedup_requests": not args.no_dedup},
        "output": {"path": str(out / "industries.parquet")},
        "commit_rows": 200, "commit_seconds": 2.0,
    })
    choices = set(spec.prompt.choices)
    kills: list = []
    if args.kill_after_rows is not None:
        job_dir = Path(str(out / "industries.parquet") + ".job")
        threading.Thread(target=killer, args=(job_dir, args.kill_after_rows, kills), daemon=True).start()
    t0 = time.time()
    result = run_job(spec, quiet=True)
    wall = time.time() - t0
    import pyarrow.parquet as pq
    import ray

    if ray.is_initialized():
        ray.shutdown()
    time.sleep(5)
    table = pq.read_table(result.output_path).to_pydict()
    ids = table["Index"]
    errors = [line for line in open(result.errors_path)] if Path(result.errors_path).exists() else []
    answers = table["industry"]
    check = {
        "rows_in": args.rows, "rows_out": len(ids), "unique_ids": len(set(ids)), "error_rows": len(errors),
        "answers_not_a_choice": sum(a not in choices for a in answers), "state": result.state,
        "answers_seen": sorted(set(answers))[:20], "wall_s": round(wall, 1), "rows_per_s": round(len(ids) / wall, 1),
        "stats": {k: v for k, v in result.stats.items() if isinstance(v, (int, float, str))},
        "kills": kills, "sglang_processes_left": sglang_processes(), "gpu_processes_left": gpu_processes(),
        "errors_sample": errors[:3],
    }
    ok = (check["rows_out"] == check["unique_ids"] == args.rows and not errors and not check["answers_not_a_choice"]
          and result.state == "finished" and not check["sglang_processes_left"] and not check["gpu_processes_left"]
          and (args.kill_after_rows is None or bool(kills)))
    check["ok"] = ok
    (out / "check.json").write_text(json.dumps(check, indent=1, default=str))
    print(json.dumps(check, default=str)[:3000])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
