"""Where Ray's start goes on a machine (issue 29: 6.7-8.9 s on the 16-core GPU machine, 2.5 s on
the 2-core CPU). Each variant is a fresh process that times ``import ray``, ``ray.init`` as
llmbatch calls it (cluster.ensure_ray: no dashboard), a first task and the shutdown: with all the
machine's CPUs (twice, first and last), with ``num_cpus=4``, and without Ray's worker prestart.

    python bench/ray_start_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, logging, os, sys, time
t0 = time.time()
import ray
t1 = time.time()
kw = json.loads(sys.argv[1])
ray.init(include_dashboard=False, logging_level=logging.ERROR, **kw)
t2 = time.time()
res = ray.cluster_resources()
@ray.remote(num_cpus=0)
def f():
    return os.getpid()
ray.get(f.remote())
t3 = time.time()
ray.shutdown()
t4 = time.time()
print(json.dumps({"import_s": round(t1 - t0, 2), "init_s": round(t2 - t1, 2), "first_task_s": round(t3 - t2, 2),
                  "shutdown_s": round(t4 - t3, 2), "cpus": res.get("CPU"), "gpus": res.get("GPU")}))
"""

VARIANTS = {
    "as llmbatch (all CPUs)": ({}, {}),
    "num_cpus=4": ({"num_cpus": 4}, {}),
    "no worker prestart": ({}, {"RAY_prestart_worker_first_driver": "0"}),
    "as llmbatch again": ({}, {}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = {}
    for name, (kw, env) in VARIANTS.items():
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw)], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=120)
        wall = round(time.time() - t0, 2)
        try:
            results[name] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_wall_s": wall}
        except Exception:  # noqa: BLE001 - a failed variant is reported, not fatal
            results[name] = {"error": (proc.stderr or proc.stdout)[-1500:], "process_wall_s": wall}
        print(name, json.dumps(results[name]), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
