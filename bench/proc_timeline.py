"""Sample the machine's processes while a benchmark runs: when each appeared, its parent, its
command line and its CPU seconds over time (what a start-up waits for, process by process).

    python bench/proc_timeline.py OUT.json [--every 0.5] -- COMMAND...

Runs COMMAND, samples every process that was not running before it every ``--every`` seconds
until it exits, writes ``{"command", "started_at", "ended_at", "rc", "procs": {pid: {"ppid",
"cmd", "first_seen", "created", "samples": [[t, cpu_s], ...]}}, "node": [[t, busy_s, steal_s,
mhz], ...]}`` (epoch seconds; ``created`` is the process's own start time). ``node`` is the whole
machine at each sample: its CPUs' busy seconds since boot (all but idle and iowait, every
process's, ours or not), the part of them the hypervisor took (steal) and the CPUs' mean clock
(MHz, None where the OS does not say): what tells a slower machine from slower code when two
sessions' figures differ."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil

FIELDS = ["ppid", "cmdline", "cpu_times", "create_time"]


def node_sample(now: float) -> list:
    """[t, busy CPU-s, steal CPU-s, mean MHz] of the whole machine."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    busy = sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    try:
        freq = psutil.cpu_freq()
    except (OSError, NotImplementedError):
        freq = None
    return [round(now, 2), round(busy, 2), round(getattr(times, "steal", 0.0), 2),
            round(freq.current) if freq else None]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--every", type=float, default=0.5)
    argv = sys.argv[1:]
    if "--" not in argv:
        p.error("the command to run goes after --")
    args, cmd = p.parse_args(argv[:argv.index("--")]), argv[argv.index("--") + 1:]
    before = set(psutil.pids())
    started = time.time()
    child = subprocess.Popen(cmd)
    procs: dict[int, dict] = {}
    node: list[list] = []
    while True:
        now = time.time()
        node.append(node_sample(now))
        for proc in psutil.process_iter(FIELDS):
            info = proc.info
            if proc.pid in before or info["cpu_times"] is None:
                continue
            line = " ".join(info["cmdline"] or [])[:160]
            entry = procs.setdefault(proc.pid, {"ppid": info["ppid"], "cmd": line, "first_seen": now,
                                                "created": info["create_time"], "samples": []})
            entry["cmd"] = line or entry["cmd"]
            entry["samples"].append([round(now, 2), info["cpu_times"].user + info["cpu_times"].system])
        if child.poll() is not None:
            break
        time.sleep(args.every)
    with open(args.out, "w") as fh:
        json.dump({"command": cmd, "started_at": started, "ended_at": time.time(), "rc": child.returncode,
                   "procs": procs, "node": node}, fh)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
