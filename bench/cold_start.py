"""A job's cold start on this machine, part by part: a user's first `llmbatch run` on a laptop.

    python bench/cold_start.py [--repeat 3] [--rows 8] [--system LABEL=SRC ...] [--out DIR]

Each run is a fresh `python -m llmbatch run` process (its own local Ray, no RAY_ADDRESS, no warm
engine: keep_warm_s 0) over a seeded customers CSV, greedy answers of 8 tokens, the output
written as Parquet. The headline is the whole process, start to exit (what a user waits for);
beside it, the job's own phases (stats.json ``phases_s``: the process's imports and CLI up to
the job, preparing it, starting Ray, Ray Data's plan and placing the replica, the engine's
start, the first answer, the rows, the output) and vLLM's own steps from the replica's engine
log (loading the weights, the engine's profile + KV cache + warm-up). ``--system LABEL=SRC``
runs another llmbatch source tree (a ``git worktree`` of an older commit) with the same Python
and packages, for a before/after in one run; systems alternate within each repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ["process", "prepare_job", "ray_start", "replica_placement", "engine_start", "first_answer", "rows",
          "output"]
VLLM_STEPS = {
    "weights_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "model_load_s": re.compile(r"Model loading took [\d.]+ \w+ (?:and|memory and) ([\d.]+) seconds"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) seconds"),
}


def one(label: str, src: str, rows: int, work: Path) -> dict:
    from llmbatch.sample_data import write_customers_csv

    work.mkdir(parents=True)
    write_customers_csv(work / "customers.csv", rows, seed=1)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "LLMBATCH_START_LOG")}
    env.update(PYTHONPATH=src, RAY_TMPDIR=str(work / "ray"), VLLM_LOGGING_LEVEL="INFO", LLMBATCH_KEEP_WARM_S="0",
               PYTHONUNBUFFERED="1")
    (work / "ray").mkdir()
    cmd = [sys.executable, "-m", "llmbatch", "run", "--input", str(work / "customers.csv"), "--id-column", "Index",
           "--model", "smollm2-135m-instruct", "--prompt", "Which industry is {Company} in? One word.",
           "--max-tokens", "8", "--temperature", "0", "--output", str(work / "out.parquet"), "--quiet",
           "--set", "model.engine_kwargs.max_model_len=512"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=1200)
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"system": label, "failed": (proc.stdout + proc.stderr)[-3000:]}
    stats = json.loads((work / "out.parquet.job" / "stats.json").read_text())
    steps: dict[str, float | None] = dict.fromkeys(VLLM_STEPS)
    for log in (work / "ray").rglob("llmbatch-engine-*.log"):
        text = log.read_text(errors="replace")
        for name, pattern in VLLM_STEPS.items():
            found = pattern.search(text)
            if found:
                steps[name] = float(found.group(1))
    return {"system": label, "wall_s": round(wall, 2), "rows": stats["rows_ok"], "phases_s": stats["phases_s"],
            "vllm_steps_s": steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--system", action="append", default=[],
                    help="LABEL=SRC: an llmbatch source tree to run (default: this checkout's src as 'current')")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    systems = [s.split("=", 1) for s in args.system] or [["current", str(HERE.parent / "src")]]
    root = Path(tempfile.mkdtemp(prefix="coldstart-", dir="/tmp"))
    runs = []
    try:
        for r in range(args.repeat):
            order = systems if r % 2 == 0 else systems[::-1]
            for label, src in order:
                result = one(label, src, args.rows, root / f"{label}-{r}")
                result["repeat"] = r
                runs.append(result)
                print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {}
    for label, _ in systems:
        ok = [x for x in runs if x["system"] == label and "wall_s" in x]
        if not ok:
            continue

        def med(values):
            values = [v for v in values if v is not None]
            return (round(statistics.median(values), 2), round(min(values), 2), round(max(values), 2)) if values else None

        summary[label] = {"wall_s": med([x["wall_s"] for x in ok]),
                          **{p: med([x["phases_s"].get(p) for x in ok]) for p in PHASES},
                          **{k: med([x["vllm_steps_s"].get(k) for x in ok]) for k in VLLM_STEPS}}
    print(f"\n{'part (median, min-max s)':28}" + "".join(f"{label:>22}" for label in summary))
    for key in ["wall_s", *PHASES, *VLLM_STEPS]:
        cells = []
        for label in summary:
            v = summary[label].get(key)
            cells.append(f"{v[0]:8.2f} ({v[1]:.1f}-{v[2]:.1f})" if v else "-")
        print(f"{key:28}" + "".join(f"{c:>22}" for c in cells))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "runs.json").write_text(json.dumps({"runs": runs, "summary": summary, "systems": systems}, indent=1))


if __name__ == "__main__":
    main()
