"""Scaling report: one replica against several (or one replica on two GPUs), from the JSON of
``bench/throughput.py --json-out`` calls whose runs were made with ``--extra "--concurrency N
--gpu-util --label NAME"``.

    python bench/scaling.py r1.json r2.json ...      # one table, grouped by each run's label

For every run: rows/s over the wall (process start to last row written) and over the engine
window (first request to last row), and for every replica its own rate (its rows over its own
first request to its last answer), when it was ready and got its first request, and its GPU's
mean utilisation while it served. ``steady`` is the sum of the replicas' own rates: what the
replicas did while each was serving, with the other's start-up and tail left out. Scaling is
each figure's median over the label's runs divided by the one-replica label's median.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def replica_rows(run: dict) -> list[dict]:
    out = []
    samples = run.get("gpu_util") or []
    for name, rep in sorted(run.get("replicas", {}).items(), key=lambda kv: kv[1]["first_request_at"]):
        window = rep["last_finished_at"] - rep["first_request_at"]
        gpus = {int(g) for g in str(rep.get("devices") or "").split(",") if g.strip().isdigit()}
        util = [u for t, g, u, _ in samples if g in gpus and rep["first_request_at"] <= t <= rep["last_finished_at"]]
        out.append({"replica": name, "gpus": sorted(gpus), "rows": rep["rows"], "window_s": window,
                    "rate": rep["rows"] / window if window > 0 else 0.0,
                    "ready_s": rep["ready_at"] - run["process_start"],
                    "first_request_s": rep["first_request_at"] - run["process_start"],
                    "last_s": rep["last_finished_at"] - run["process_start"],
                    "gpu_util": statistics.mean(util) if util else None})
    return out


def util_timeline(run: dict, step: float = 5.0) -> dict[int, list[int]]:
    """Each GPU's mean utilisation per ``step`` seconds from the process start."""
    by_gpu: dict[int, dict[int, list[float]]] = {}
    for t, g, u, _ in run.get("gpu_util") or []:
        by_gpu.setdefault(int(g), {}).setdefault(int((t - run["process_start"]) // step), []).append(u)
    out = {}
    for g, buckets in sorted(by_gpu.items()):
        last = max(buckets)
        out[g] = [round(statistics.mean(buckets[b])) if b in buckets else -1 for b in range(last + 1)]
    return out


def main(paths: list[str]) -> None:
    runs = [r for p in paths for r in json.loads(Path(p).read_text()) if "error" not in r]
    labels: dict[str, list[dict]] = {}
    for r in runs:
        labels.setdefault(r.get("label") or f"{r['system']} x{r.get('concurrency', 1)}", []).append(r)
    print("| configuration | run | rows | wall s | rows/s, wall | rows/s, engine window | steady rows/s "
          "(sum of replicas' own rates) | replica: ready s / first request s / last answer s / rows / own rows/s / GPU util % |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    medians = {}
    for label, rs in labels.items():
        walls, windows, steadies = [], [], []
        for i, r in enumerate(rs, 1):
            reps = replica_rows(r)
            steady = sum(x["rate"] for x in reps)
            walls.append(r["rows"] / r["wall_s"])
            windows.append(r["rows"] / r["engine_window_s"])
            steadies.append(steady)
            detail = "; ".join(
                f"GPU {','.join(map(str, x['gpus'])) or '?'}: {x['ready_s']:.1f} / {x['first_request_s']:.1f} / "
                f"{x['last_s']:.1f} / {x['rows']} / {x['rate']:.1f} / "
                + (f"{x['gpu_util']:.0f}" if x["gpu_util"] is not None else "-") for x in reps)
            print(f"| {label} | {i} | {r['rows']} | {r['wall_s']:.1f} | {walls[-1]:.1f} | {windows[-1]:.1f} | "
                  f"{steady:.1f} | {detail} |")
        medians[label] = tuple(statistics.median(v) for v in (walls, windows, steadies))
    base = next((m for label, m in medians.items() if label.endswith("x1")), None)
    if base:
        print("\nScaling against one replica (medians): " + "; ".join(
            f"{label}: wall {m[0] / base[0]:.2f}x, engine window {m[1] / base[1]:.2f}x, steady {m[2] / base[2]:.2f}x"
            for label, m in medians.items()))
    for label, rs in labels.items():
        for i, r in enumerate(rs, 1):
            timeline = util_timeline(r)
            if timeline:
                print(f"\nGPU utilisation, {label} run {i}, mean per 5 s from the process start (-1: no sample):")
                for g, series in timeline.items():
                    print(f"  GPU {g}: {' '.join(map(str, series))}")


if __name__ == "__main__":
    main(sys.argv[1:])
