"""Throughput harness: the same prompts through plain vLLM, llmbatch (and ray.data.llm).

    python bench/throughput.py                          # 500 unique prompts: vLLM vs llmbatch
    python bench/throughput.py --workloads unique,customers,duplicates,mixed --systems vllm,llmbatch,ray

Each (workload, system) runs in a fresh process, one after another, on the same model and
engine settings; the table shows rows/s and tokens/s over the steady part of each run (from
the moment the engine was ready to the last row) and over the whole run (start-up included),
plus the ratios llmbatch/vLLM and llmbatch/ray.data.llm from this same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_one(system: str, workload: str, args, extra: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="llmbatch-bench-")) / "result.json"
    cmd = [sys.executable, str(HERE / "run_system.py"), "--system", system, "--workload", workload,
           "--rows", str(args.rows), "--model", args.model, "--device", args.device, "--out", str(out),
           "--max-model-len", str(args.max_model_len), "--batch-size", str(args.batch_size), *extra]
    if args.load_format:
        cmd += ["--load-format", args.load_format]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    log = out.with_name("run.log")
    start = time.perf_counter()
    with open(log, "w") as fh:  # a file, not a pipe: engine processes that outlive a run cannot block us
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout,
                              start_new_session=True)
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-3000:]
        return {"system": system, "workload": workload, "error": f"exit {proc.returncode} (log {log}): {tail}"}
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - start
    return result


def median_run(runs: list[dict]) -> dict:
    """The run with the median steady time (errors only if every run failed)."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["steady_s"])
    if not ok:
        return runs[0]
    chosen = dict(ok[(len(ok) - 1) // 2])
    chosen["repeats"] = [round(r["steady_s"], 1) for r in ok]
    return chosen


def rates(r: dict) -> dict:
    if "error" in r:
        return {}
    steady = max(1e-9, r["steady_s"])
    wall = max(1e-9, r["wall_s"])
    return {
        "rows_s": r["rows"] / steady,
        "out_tok_s": r["output_tokens"] / steady,
        "total_tok_s": (r["output_tokens"] + r["input_tokens"]) / steady,
        "wall_rows_s": r["rows"] / wall,
        "wall_out_tok_s": r["output_tokens"] / wall,
        "first_result_s": r["first_result_s"],
    }


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
    p.add_argument("--repeat", type=int, default=1, help="runs per system, interleaved (A B A B); the table shows medians")
    p.add_argument("--rows-per-workload", default="", help="e.g. mixed=120,dates=300 (others use --rows)")
    args = p.parse_args()
    systems = args.systems.split(",")
    per_workload = dict(item.split("=") for item in args.rows_per_workload.split(",") if item)
    results = []
    for workload in args.workloads.split(","):
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        wargs = argparse.Namespace(**{**vars(args), "rows": int(per_workload.get(workload, args.rows))})
        for _ in range(args.repeat):
            for system in systems:
                r = run_one(system, workload, wargs, args.extra.split())
                runs[system].append(r)
                results.append(r)
                status = r.get("error", "")[:300] if "error" in r else f"{r['rows']} rows, steady {r['steady_s']:.1f}s, wall {r['wall_s']:.1f}s"
                print(f"[bench] {workload:10s} {system:12s} {status}", flush=True)
        print_table(workload, {s: median_run(rs) for s, rs in runs.items()})
    if args.json_out:
        slim = [{k: v for k, v in r.items() if k != "texts"} for r in results]
        Path(args.json_out).write_text(json.dumps(slim, indent=2))


def print_table(workload: str, by_system: dict) -> None:
    print(f"\n## workload: {workload}\n")
    print("| system | rows/s | output tok/s | total tok/s | rows/s (wall) | output tok/s (wall) | first result (s) | steady s (runs) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for system, r in by_system.items():
        m = rates(r)
        if not m:
            print(f"| {system} | failed | | | | | |")
            continue
        print(f"| {system} | {m['rows_s']:.2f} | {m['out_tok_s']:.1f} | {m['total_tok_s']:.1f} | {m['wall_rows_s']:.2f} | "
              f"{m['wall_out_tok_s']:.1f} | {m['first_result_s']:.1f} | {r.get('repeats', [round(r['steady_s'], 1)])} |")
    lb = rates(by_system.get("llmbatch", {})) if "llmbatch" in by_system else {}
    for ref in ("vllm", "ray"):
        if ref in by_system and lb and rates(by_system[ref]):
            extra = by_system["llmbatch"]
            if extra.get("dedup_ratio") is not None:
                print(f"llmbatch dedup ratio {extra['dedup_ratio']}, prefix-cache hit rate {extra.get('prefix_cache_hit_rate')}")
            m = rates(by_system[ref])
            agree = same_answers(by_system["llmbatch"], by_system[ref])
            agree_text = f", same answers on {agree:.0%} of rows" if agree is not None else ""
            print(f"\nllmbatch / {ref}: output tok/s {lb['out_tok_s'] / m['out_tok_s']:.3f}, rows/s "
                  f"{lb['rows_s'] / m['rows_s']:.3f} (steady); rows/s {lb['wall_rows_s'] / m['wall_rows_s']:.3f} (wall){agree_text}")
    print(flush=True)


if __name__ == "__main__":
    main()
