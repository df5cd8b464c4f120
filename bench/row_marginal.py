"""What one more row costs, whole process: the seeds' industry job as a real ``llmbatch run``
process on a small and a large input whose rows share a dozen companies (so the engine's work is
the same on both), marginal = (wall_large - wall_small) / (rows_large - rows_small).

    python bench/row_marginal.py [--rows 1000,100000] [--distinct 12] [--repeat 3]
        [--system LABEL=SRC ...] [--model smollm2-135m-instruct] [--engine-kwargs JSON]
        [--set FIELD=VALUE ...] [--out FILE]

The job (issue 29's first figures): a system prompt, the user turn "What industry is this
company in: {Company}", a choice among nine industries, temperature 0, max_tokens 16, on
``llmbatch sample --seed 0`` customers whose companies are cut to the first ``--distinct`` ones
(row i gets company i mod N). Every run is a fresh process (``python -m llmbatch run``) in a
fresh folder; ``--system`` runs another source tree (a git worktree or ``git archive`` of an
older commit) with the same Python and packages; sizes and systems alternate within each
repeat, the order turning each round. Per run: the process's wall (launch to exit), the job's
own phases (``stats.json`` ``phases_s``), the CPU seconds of the process and its children, and
the engine's requests in flight over time (from the committed rows' stats: each answered row
records how many requests its replica's engine held when it finished).
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEM = "You are a helpful assistant that classifies companies by industry. Answer with the industry only."
USER = "What industry is this company in: {Company}"
CHOICES = ["Law Firm", "Healthcare", "Technology", "Retail", "Consulting", "Manufacturing", "Finance",
           "Real Estate", "Other"]


def write_input(path: Path, rows: int, distinct: int, src: str) -> int:
    """``llmbatch sample --rows N --seed 0``, companies cut to the first ``distinct`` (0: as sampled)."""
    subprocess.run([sys.executable, "-m", "llmbatch", "sample", str(path), "--rows", str(rows), "--seed", "0"],
                   env={**os.environ, "PYTHONPATH": src}, check=True, capture_output=True, timeout=600)
    if not distinct:
        with path.open(newline="") as f:
            return len({r["Company"] for r in csv.DictReader(f)})
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        fields, records = reader.fieldnames, list(reader)
    companies = list(dict.fromkeys(r["Company"] for r in records))[:distinct]
    for i, record in enumerate(records):
        record["Company"] = companies[i % len(companies)]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(records)
    return len(companies)


def job_yaml(folder: Path, model: str, engine_kwargs: dict) -> Path:
    job = {"input": {"path": str(folder / "in.csv"), "id_column": "Index"},
           "model": {"source": model, "engine_kwargs": engine_kwargs, "keep_warm_s": 0},
           "prompt": {"system": SYSTEM, "user": USER, "choices": CHOICES},
           "sampling_params": {"temperature": 0, "max_tokens": 16},
           "output": {"path": str(folder / "out.parquet")}}
    path = folder / "job.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


def in_flight_timeline(job_dir: Path, step: float = 1.0) -> list[list[float]]:
    """[seconds since the first answer, rows answered in that step, max and median of the
    requests the engine held as they finished] per ``step`` seconds, from the committed rows."""
    import pyarrow.parquet as pq

    import pyarrow.compute as pc

    points = []
    for part in sorted(glob.glob(str(job_dir / "parts" / "*.parquet"))):
        stats = pq.read_table(part, columns=["__llmbatch_stats"]).column(0)
        if stats.null_count == len(stats) or not hasattr(stats.type, "get_field_index"):
            continue
        sent = pc.invert(pc.fill_null(pc.struct_field(stats, "deduped"), True))  # rows answered by the engine
        for st in stats.filter(sent).to_pylist():
            if st and st.get("finished_at"):
                points.append((st["finished_at"], st.get("in_flight") or 0))
    if not points:
        return []
    points.sort()
    origin, buckets = points[0][0], {}
    for at, n in points:
        buckets.setdefault(int((at - origin) / step), []).append(n)
    return [[round(k * step, 1), len(v), max(v), statistics.median(v)] for k, v in sorted(buckets.items())]


def one_run(src: str, rows: int, distinct: int, model: str, engine_kwargs: dict, sets: list[str],
            keep: str = "") -> dict:
    folder = Path(tempfile.mkdtemp(prefix="row-marginal-"))
    companies = write_input(folder / "in.csv", rows, distinct, src)
    job = job_yaml(folder, model, engine_kwargs)
    cmd = [sys.executable, "-m", "llmbatch", "run", str(job), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True, timeout=3000)
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    job_dir = folder / "out.parquet.job"
    result = {"rows": rows, "distinct": companies, "rc": proc.returncode, "wall_s": round(wall, 2),
              "cpu_s_reaped_children": round((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 2)}
    if proc.returncode != 0:
        result["stderr"] = proc.stderr[-3000:]
        return result
    stats = json.loads((job_dir / "stats.json").read_text())
    import pyarrow.parquet as pq

    out = pq.read_table(folder / "out.parquet")
    ids = out.column("Index").to_pylist()
    result.update(rows_ok=stats["rows_ok"], rows_error=stats["rows_error"], ids_once=len(ids) == len(set(ids)) == rows,
                  deduplicated_rows=stats["deduplicated_rows"], generated_tokens=stats["generated_tokens"],
                  phases_s=stats["phases_s"], in_flight=in_flight_timeline(job_dir))
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"stats-{rows}-{int(t0)}.json").write_text(json.dumps(stats, indent=1))
    return result


def row_phases(run: dict) -> float:
    """Seconds of a run's phases that grow with its rows: preparing the job (reading the input
    once), the rows, writing the output."""
    ph = run["phases_s"]
    return sum(ph.get(k) or 0.0 for k in ("prepare_job", "rows", "output"))


def summarize(runs: list[dict], systems: list[list[str]], sizes: list[int]) -> dict:
    summary = {}
    for label, _ in systems:
        mine = [r for r in runs if r["system"] == label and r.get("rc") == 0]
        entry = {}
        for n in sizes:
            walls = [r["wall_s"] for r in mine if r["rows"] == n]
            rows_phase = [r["phases_s"]["rows"] for r in mine if r["rows"] == n and r["phases_s"].get("rows") is not None]
            if walls:
                entry[str(n)] = {"wall_s": [statistics.median(walls), min(walls), max(walls)],
                                 "rows_phase_s": [statistics.median(rows_phase), min(rows_phase), max(rows_phase)]
                                 if rows_phase else None}
        if len(sizes) == 2 and all(str(n) in entry for n in sizes):
            small, large = sizes
            per = [(rl["wall_s"] - rs["wall_s"]) / (large - small) * 1e6
                   for rs, rl in zip([r for r in mine if r["rows"] == small], [r for r in mine if r["rows"] == large])]
            entry["marginal_us_per_row"] = [round(statistics.median(per), 1), round(min(per), 1), round(max(per), 1)]
            entry["marginal_us_per_row_of_medians"] = round(
                (entry[str(large)]["wall_s"][0] - entry[str(small)]["wall_s"][0]) / (large - small) * 1e6, 1)
            # the phases that grow with the rows (reading the input, the rows, the output), less
            # moved by the start-up's noise on a shared machine (Ray's start, the engine's)
            scaling = {n: statistics.median(row_phases(r) for r in mine if r["rows"] == n) for n in sizes}
            entry["marginal_us_per_row_rows_phases"] = round((scaling[large] - scaling[small]) / (large - small) * 1e6, 1)
        summary[label] = entry
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1000,100000")
    ap.add_argument("--distinct", type=int, default=12, help="distinct companies (0: as sampled)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--system", action="append", default=[])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--engine-kwargs", default='{"max_model_len": 512}')
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--keep", default="", help="a folder for each run's stats.json")
    ap.add_argument("--out", default="")
    ap.add_argument("--summarize", default="", help="print the summary of an --out file's runs")
    args = ap.parse_args()
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        print(json.dumps(summarize(saved["runs"], saved["systems"], sorted({r["rows"] for r in saved["runs"]})), indent=1))
        return
    sizes = [int(n) for n in args.rows.split(",")]
    systems = [s.split("=", 1) for s in args.system] or [["current", str(Path(__file__).resolve().parent.parent / "src")]]
    plan = [(label, src, n) for label, src in systems for n in sizes]
    runs = []
    for r in range(args.repeat):
        for label, src, n in (plan if r % 2 == 0 else plan[::-1]):
            result = one_run(src, n, args.distinct, args.model, json.loads(args.engine_kwargs), args.sets, args.keep)
            runs.append({"system": label, "repeat": r, **result})
            brief = {k: v for k, v in runs[-1].items() if k != "in_flight"}
            print(json.dumps(brief), flush=True)
            if args.out:  # raw results so far, in case a later run is cut off
                Path(args.out).write_text(json.dumps({"runs": runs, "systems": systems}, indent=1))
    summary = summarize(runs, systems, sizes)
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary, "systems": systems,
                                              "job": {"system": SYSTEM, "user": USER, "choices": CHOICES,
                                                      "temperature": 0, "max_tokens": 16, "model": args.model,
                                                      "engine_kwargs": json.loads(args.engine_kwargs),
                                                      "sets": args.sets}}, indent=1))


if __name__ == "__main__":
    main()
