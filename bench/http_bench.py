"""HTTP endpoints: llmbatch's HttpRequestProcessorConfig vs Ray's (ray.data.llm), same concurrency.

    python bench/http_bench.py --rows 2000 --concurrency 2 --latency 0.2 --repeats 3 --out bench/http-results

Each run is a fresh process (its own local Ray, ``num_cpus=8`` logical CPUs for both systems, as
Ray's processor cannot schedule its read tasks beside its HTTP actors on 2 real CPUs) against a
fresh loopback OpenAI-compatible server (tests/e2e/fake_openai.py) that answers every request
after a fixed latency. The same rows (distinct payloads), the same ``batch_size`` (Ray's default,
64) and the same ``concurrency`` (workers) for both; everything else at each system's defaults.
Runs alternate between the systems; the table has the median and the min-max.

Figures: rows/s over the whole process (start to last row taken) and rows/s from the first
request the server saw to the last row taken; the server's most requests in flight at once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

STARTED = time.time()  # the child's process start, as near as Python allows
HERE = Path(__file__).resolve().parent
SERVER = HERE.parent / "tests" / "e2e" / "fake_openai.py"


def child(args) -> None:
    """One run of one system; writes its JSON result."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    if args.system == "ray":
        from ray.data.llm import HttpRequestProcessorConfig, build_processor
    else:
        from llmbatch import HttpRequestProcessorConfig, build_processor
    config = HttpRequestProcessorConfig(url=f"{args.url}/v1/chat/completions", concurrency=args.concurrency,
                                        batch_size=args.batch_size)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(payload=dict(model="m", messages=[{"role": "user", "content": f"row {row['i']}"}],
                                                 temperature=0.0, max_tokens=8)),
        postprocess=lambda row: dict(i=row["i"], answer=row["http_response"]["choices"][0]["message"]["content"]))
    rows = processor(ray.data.from_items([{"i": i} for i in range(args.rows)])).take_all()
    ended = time.time()
    assert sorted(r["i"] for r in rows) == list(range(args.rows)), "rows lost or repeated"
    assert all(r["answer"] == f"answer to row {r['i']}" for r in rows)
    seen = json.loads(urllib.request.urlopen(f"{args.url}/stats", timeout=10).read())
    result = {
        "system": args.system, "rows": args.rows, "concurrency": args.concurrency, "batch_size": args.batch_size,
        "latency_s": args.latency, "wall_s": round(ended - STARTED, 3),
        "rows_per_s": round(args.rows / (ended - STARTED), 2),
        "first_request_to_last_row_s": round(ended - seen["first_at"], 3),
        "rows_per_s_from_first_request": round(args.rows / (ended - seen["first_at"]), 2),
        "server_max_in_flight": seen["max_in_flight"], "server_requests": seen["attempts"],
        "versions": {"ray": ray.__version__, "python": sys.version.split()[0]},
    }
    Path(args.result).write_text(json.dumps(result, indent=2))
    ray.shutdown()


def start_server(latency: float, work: Path) -> tuple[subprocess.Popen, str]:
    port_file = work / "port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port-file", str(port_file), "--latency", str(latency)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the fake server did not start")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


def parent(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {"ray": [], "llmbatch": []}
    for repeat in range(args.repeats):
        order = ["ray", "llmbatch"] if repeat % 2 == 0 else ["llmbatch", "ray"]
        for system in order:
            proc, url = start_server(args.latency, out)
            result_path = out / f"{system}-c{args.concurrency}-rows{args.rows}-run{repeat + 1}.json"
            try:
                cmd = [sys.executable, __file__, "--child", "--system", system, "--url", url, "--rows", str(args.rows),
                       "--concurrency", str(args.concurrency), "--batch-size", str(args.batch_size),
                       "--latency", str(args.latency), "--result", str(result_path)]
                env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
                env.pop("RAY_ADDRESS", None)
                subprocess.run(cmd, check=True, env=env, timeout=args.timeout)
            finally:
                proc.kill()
                proc.wait()
            result = json.loads(result_path.read_text())
            results[system].append(result)
            print(f"run {repeat + 1} {system:9s} {result['rows_per_s']:8.1f} rows/s whole process, "
                  f"{result['rows_per_s_from_first_request']:8.1f} from first request, "
                  f"{result['server_max_in_flight']} in flight", flush=True)
    table(results)


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def table(results: dict[str, list[dict]]) -> None:
    print("\n| system | rows/s, whole process | rows/s, first request to last row | requests in flight (max) |")
    print("| --- | --- | --- | --- |")
    for system in ("ray", "llmbatch"):
        runs = results[system]
        print(f"| {system} | {_fmt([r['rows_per_s'] for r in runs])} | "
              f"{_fmt([r['rows_per_s_from_first_request'] for r in runs])} | "
              f"{max(r['server_max_in_flight'] for r in runs)} |")
    for key in ("rows_per_s", "rows_per_s_from_first_request"):
        ratio = statistics.median(r[key] for r in results["llmbatch"]) / statistics.median(r[key] for r in results["ray"])
        print(f"llmbatch / ray ({key}, medians): {ratio:.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(HERE / "http-results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=["ray", "llmbatch"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    child(ns) if ns.child else parent(ns)
