"""Sample the machine's processes while a benchmark runs: when each appeared, its parent, its
command line and its CPU seconds over time (what a start-up waits for, process by process).

    python bench/proc_timeline.py OUT.json [--every 0.5] -- COMMAND...

Runs COMMAND, samples every process that was not running before it every ``--every`` seconds
until it exits, writes ``{"command", "started_at", "ended_at", "rc", "procs": {pid: {"ppid",
"cmd", "first_seen", "created", "samples": [[t, cpu_s], ...]}}}`` (epoch seconds; ``created`` is
the process's own start time)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil

FIELDS = ["ppid", "cmdline", "cpu_times", "create_time"]


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
    while True:
        now = time.time()
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
                   "procs": procs}, fh)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
