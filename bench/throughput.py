"""Throughput harness: the same prompts through plain vLLM, llmbatch (and ray.data.llm).

    python bench/throughput.py                          # 500 unique prompts: vLLM vs llmbatch
    python bench/throughput.py --workloads unique,customers,duplicates,mixed --systems vllm,llmbatch,ray
    python bench/throughput.py --merge r1.json r2.json r3.json  # one table from several calls' --json-out
    python bench/throughput.py --systems vllm,llmbatch,llmbatch@old --src old=/tmp/old/src  # older code beside

A system ``NAME@TAG`` is system NAME run on the llmbatch source tree ``--src TAG=DIR`` (put first
on the child's ``PYTHONPATH``; everything else, ``run_system.py`` and its pinned settings
included, is this tree's): old and new code in the same interleaved rounds.

Each (workload, system) runs in a fresh process (``run_system.py``), on the same model,
prompts and pinned engine settings; every system writes its answers to a Parquet file.
Repeats are interleaved and the order turns each round (A B C, C B A, A B C, ...).

Headline: rows/s over the **wall** time, from the process start to the last row written
(what a user waits for). Second figure, measured the same way for every system: rows/s over
the **engine window**, from the first request handed to any engine to the last row written.
Both as the median over the repeats with the min-max; ratios are of medians from this same
invocation. Generated tokens (what the engine produced) and delivered tokens (what the output
holds, answers copied by dedup included) are reported apart. Raw runs go to ``--json-out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_one(system: str, workload: str, args, extra: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="llmbatch-bench-")) / "result.json"
    name, _, tag = system.partition("@")
    cmd = [sys.executable, str(HERE / "run_system.py"), "--system", name, "--workload", workload,
           "--rows", str(args.rows), "--model", args.model, "--device", args.device, "--out", str(out),
           "--max-model-len", str(args.max_model_len), "--batch-size", str(args.batch_size), *extra]
    if args.load_format:
        cmd += ["--load-format", args.load_format]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    if tag:  # another llmbatch tree: first on the path (Ray's workers inherit the variable)
        src = str(Path(args.src[tag]).resolve())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    log = out.with_name("run.log")
    with open(log, "w") as fh:  # a file, not a pipe: engine processes that outlive a run cannot block us
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout,
                              start_new_session=True)
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-3000:]
        return {"system": system, "workload": workload, "error": f"exit {proc.returncode} (log {log}): {tail}"}
    result = json.loads(out.read_text())
    if tag:
        result.update(system=system, src=args.src[tag])
    return result


def summary(runs: list[dict]) -> dict:
    """Median and min-max over the successful runs of one system."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {}

    def spread(values: list[float]) -> tuple[float, float, float]:
        return statistics.median(values), min(values), max(values)

    return {
        "runs": len(ok), "failed": len(runs) - len(ok),
        "wall_rows_s": spread([r["rows"] / r["wall_s"] for r in ok]),
        "window_rows_s": spread([r["rows"] / r["engine_window_s"] for r in ok]),
        "wall_s": spread([r["wall_s"] for r in ok]),
        "window_s": spread([r["engine_window_s"] for r in ok]),
        "to_first_request_s": spread([r["first_request_at"] - r["process_start"] for r in ok]),
        "generated_tok_s": spread([r["generated_tokens"] / r["engine_window_s"] for r in ok]),
        "delivered_tok_s": spread([r["output_tokens"] / r["engine_window_s"] for r in ok]),
        "estimated": any(r.get("first_request_estimated") for r in ok),
        "phases_s": _median_phases([r["phases_s"] for r in ok if r.get("phases_s")]),
        "last": ok[-1],
    }


def _median_phases(runs: list[dict]) -> dict | None:
    """Each start-up phase's median over the runs that recorded phases."""
    if not runs:
        return None
    keys = [k for k in runs[0] if all(r.get(k) is not None for r in runs)]
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}


def same_answers(a: dict, b: dict) -> float | None:
    ta, tb = a.get("texts"), b.get("texts")
    if not ta or not tb:
        return None
    keys = set(map(str, ta)) & set(map(str, tb))
    if not keys:
        return None
    ta = {str(k): v for k, v in ta.items()}
    tb = {str(k): v for k, v in tb.items()}
    return sum(ta[k] == tb[k] for k in keys) / len(keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="unique")
    p.add_argument("--systems", default="vllm,llmbatch")
    p.add_argument("--rows", type=int, default=500)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu" if os.path.exists("/dev/nvidia0") else "cpu")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--load-format", default=None)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--json-out", default=None, help="also write all results here")
    p.add_argument("--extra", default="", help="extra arguments for run_system.py (e.g. --no-dedup)")
    p.add_argument("--repeat", type=int, default=3, help="runs per system, interleaved, order turning each round")
    p.add_argument("--rows-per-workload", default="", help="e.g. mixed=120,dates=300 (others use --rows)")
    p.add_argument("--merge", nargs="+", help="print one table from the --json-out files of several calls")
    p.add_argument("--src", action="append", default=[], metavar="TAG=DIR",
                   help="an llmbatch source tree (its src/ folder) for systems named NAME@TAG")
    args = p.parse_args()
    args.src = dict(item.split("=", 1) for item in args.src)
    for system in args.systems.split(","):
        if "@" in system and system.partition("@")[2] not in args.src:
            p.error(f"system {system}: no --src {system.partition('@')[2]}=DIR")
    if args.merge:
        return merge(args.merge)
    systems = args.systems.split(",")
    extra = args.extra.split()
    if args.device == "cpu" and "--dtype" not in extra:
        # one dtype for every system, decided once here (an older tree may not know how): the
        # float32 llmbatch picks on a CPU without native bfloat16
        from llmbatch.engines.vllm_setup import native_bf16

        extra += ["--dtype", "auto" if native_bf16() else "float32"]
    per_workload = dict(item.split("=") for item in args.rows_per_workload.split(",") if item)
    results = []
    for workload in args.workloads.split(","):
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        wargs = argparse.Namespace(**{**vars(args), "rows": int(per_workload.get(workload, args.rows))})
        for round_ in range(args.repeat):
            for system in (systems if round_ % 2 == 0 else systems[::-1]):
                r = run_one(system, workload, wargs, extra)
                r["round"] = round_ + 1
                runs[system].append(r)
                results.append(r)
                status = r.get("error", "")[:300] if "error" in r else (
                    f"{r['rows']} rows, wall {r['wall_s']:.1f}s, engine window {r['engine_window_s']:.1f}s")
                print(f"[bench] {workload:10s} {system:12s} {status}", flush=True)
        print_table(workload, {s: summary(rs) for s, rs in runs.items()})
    if args.json_out:
        slim = [{k: v for k, v in r.items() if k != "texts"} for r in results]  # answers stay in the run folders
        Path(args.json_out).write_text(json.dumps(slim, indent=2))


def merge(paths: list[str]) -> None:
    """One table per workload from the runs of several calls (e.g. one round per call on a
    lent machine, the order turned between calls)."""
    runs = [r for path in paths for r in json.loads(Path(path).read_text())]
    for workload in dict.fromkeys(r["workload"] for r in runs):
        systems = dict.fromkeys(r["system"] for r in runs if r["workload"] == workload)
        print_table(workload, {s: summary([r for r in runs if r["workload"] == workload and r["system"] == s])
                               for s in systems})


def print_table(workload: str, by_system: dict) -> None:
    def fmt(t: tuple, digits: int = 2) -> str:
        return f"{t[0]:.{digits}f} ({t[1]:.{digits}f}-{t[2]:.{digits}f})"

    print(f"\n## workload: {workload}\n")
    print("| system | runs | rows/s, wall (min-max) | rows/s, engine window | wall s | to first request s | "
          "generated tok/s | delivered tok/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for system, m in by_system.items():
        if not m:
            print(f"| {system} | failed | | | | | | |")
            continue
        mark = " (est.)" if m["estimated"] else ""
        print(f"| {system} | {m['runs']} | {fmt(m['wall_rows_s'])} | {fmt(m['window_rows_s'])}{mark} | {fmt(m['wall_s'], 1)} | "
              f"{fmt(m['to_first_request_s'], 1)} | {fmt(m['generated_tok_s'], 0)} | {fmt(m['delivered_tok_s'], 0)} |")
    for name in ("llmbatch", "llmbatch-job", "llmbatch-cli"):
        lb = by_system.get(name)
        if not lb:
            continue
        for ref in ("vllm", "ray"):
            m = by_system.get(ref)
            if not m:
                continue
            agree = same_answers(lb["last"], m["last"])
            agree_text = f"; same answers on {agree:.0%} of rows" if agree is not None else ""
            print(f"\n{name} / {ref} (medians): rows/s wall {lb['wall_rows_s'][0] / m['wall_rows_s'][0]:.3f}, "
                  f"engine window {lb['window_rows_s'][0] / m['window_rows_s'][0]:.3f}{agree_text}")
        phases = lb.get("phases_s")
        if phases:
            print(f"{name} phases (median of {lb['runs']} runs, s): " + ", ".join(f"{k} {v}" for k, v in phases.items()))
    print(flush=True)


if __name__ == "__main__":
    main()
