"""A Ray cluster of 3 nodes on this machine (``ray.cluster_utils.Cluster``), in a process of
its own so that the test process's own Ray state (a session cluster it may be joined to) is
never touched. Used by tests/e2e/test_cluster_nodes.py.

Prints one JSON line: the address and each worker node's raylet pid; then reads commands from
stdin: ``remove <k>`` removes worker node k at once (its processes killed, as when a machine
dies) and answers ``removed``; ``stop`` (or end of input) removes every node and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-cpus", type=int, default=1)
    parser.add_argument("--worker-cpus", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    from ray.cluster_utils import Cluster

    from llmbatch import startlog

    store = 100 * 1024 * 1024
    t0 = time.time()
    startlog.record("ray-cluster", t0, None, nodes=1 + args.workers)
    # a node that stops answering is declared dead after ~2 s (Ray's default: ~30 s)
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=args.head_cpus, include_dashboard=False, object_store_memory=store,
        _system_config={"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                        "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}))
    try:
        workers = [cluster.add_node(num_cpus=args.worker_cpus, object_store_memory=store)
                   for _ in range(args.workers)]
        cluster.wait_for_nodes()
        startlog.record("ray-cluster", t0, time.time() - t0, nodes=1 + args.workers)
        print(json.dumps({"address": cluster.address,
                          "raylets": [w.all_processes["raylet"][0].process.pid for w in workers]}), flush=True)
        for line in sys.stdin:
            command = line.split()
            if command[:1] == ["remove"]:
                cluster.remove_node(workers[int(command[1])], allow_graceful=False)
                print("removed", flush=True)
            elif command[:1] == ["stop"]:
                break
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
