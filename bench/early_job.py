"""A short job through the CLI, with and without the engine launched by the driver, phase by phase.

    python bench/early_job.py --system old=/tmp/old/src:1 --system new=src:1 --system new-off=src:0 \
        --rows 200 --repeat 3 --out bench/probe-results/early-job.json

Each ``--system TAG=SRC:EARLY`` runs ``python -m llmbatch run job.yaml --quiet`` with ``SRC`` first
on ``PYTHONPATH`` and ``LLMBATCH_ENGINE_EARLY=EARLY``; the systems alternate, the order turning
each round. The job: ``--rows`` distinct prompts (SmolLM2-135M, greedy, ``--max-tokens`` tokens,
``max_model_len`` 512). Per run, seconds from the process's start (``Popen``) to: the launcher's
start (the start-up ledger's ``launched_early`` line), its engine ready, the replica's engine
start ended (attached or its own), the first request (stats.json), the process's exit; every id
once is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPANIES = ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Vandelay", "Stark", "Wayne", "Wonka", "Tyrell"]


def write_job(folder: Path, rows: int, max_tokens: int) -> Path:
    with open(folder / "in.jsonl", "w") as fh:
        for i in range(rows):
            fh.write(json.dumps({"id": i, "text": f"Describe {COMPANIES[i % 10]} number {i} in one line."}) + "\n")
    job = folder / "job.yaml"
    job.write_text(json.dumps({
        "input": {"path": str(folder / "in.jsonl"), "id_column": "id"},
        "model": {"source": "smollm2-135m-instruct", "engine_kwargs": {"max_model_len": 512}, "batch_size": 32},
        "prompt": {"user": "{text}"}, "sampling_params": {"temperature": 0, "max_tokens": max_tokens},
        "output": {"path": str(folder / "out.parquet"), "columns": ["id", "generated_text"]},
    }))
    return job


def one_run(tag: str, src: str, early: str, rows: int, max_tokens: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"early-{tag}-"))
    job = write_job(folder, rows, max_tokens)
    ledger = folder / "starts.jsonl"
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "LLMBATCH_ENGINE_EARLY": early,
           "LLMBATCH_START_LOG": str(ledger)}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "llmbatch", "run", str(job), "--quiet"], env=env, cwd=folder,
                          capture_output=True, text=True, timeout=900)
    end = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{tag}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in ledger.read_text().splitlines()]
    ends = [x for x in lines if x.get("kind") == "vllm-engine" and "seconds" in x]
    launched = [x for x in ends if x.get("launched_early")]
    replica = [x for x in ends if not x.get("launched_early")]
    stats_path = next(folder.glob("**/stats.json"))
    stats = json.loads(stats_path.read_text())
    import pyarrow.parquet as pq

    ids = sorted(pq.read_table(stats["output"]).column("id").to_pylist())
    assert ids == list(range(rows)), f"{tag}: ids not once each"

    def at(x: float | None) -> float | None:
        return None if x is None else round(x - t0, 2)

    return {"system": tag, "early": early, "wall_s": round(end - t0, 2),
            "launcher_start_s": at(launched[0]["t0"]) if launched else None,
            "launcher_spec_after_s": launched[0].get("spec_after_s") if launched else None,
            "launcher_imported_s": launched[0].get("imported_s") if launched else None,
            "launched_ready_s": at(launched[0]["t0"] + launched[0]["seconds"]) if launched else None,
            "replica_engine_start_s": at(replica[0]["t0"]) if replica else None,
            "replica_engine_ready_s": at(replica[0]["t0"] + replica[0]["seconds"]) if replica else None,
            "first_request_s": at(stats.get("first_request_at")), "phases_s": stats.get("phases_s"),
            "generated_tokens": stats.get("generated_tokens")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", action="append", required=True, metavar="TAG=SRC:EARLY")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    systems = [(s.split("=", 1)[0], *s.split("=", 1)[1].rsplit(":", 1)) for s in args.system]
    runs = []
    for r in range(args.repeat):
        order = systems if r % 2 == 0 else systems[::-1]
        for tag, src, early in order:
            runs.append(one_run(tag, src, early, args.rows, args.max_tokens))
            print(json.dumps(runs[-1]), flush=True)
            Path(args.out).write_text(json.dumps({"argv": sys.argv, "runs": runs}, indent=1))
    keys = ["wall_s", "launcher_start_s", "launched_ready_s", "replica_engine_ready_s", "first_request_s"]
    print("| system | " + " | ".join(keys) + " |")
    print("| --- |" + " ---: |" * len(keys))
    for tag, _, _ in systems:
        cells = []
        for k in keys:
            vals = [x[k] for x in runs if x["system"] == tag and x[k] is not None]
            cells.append(f"{statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})" if vals else "-")
        print(f"| {tag} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
