"""Sample the machine's processes while a benchmark runs: when each appeared, its parent, its
command line and its CPU seconds over time (what a start-up waits for, process by process).

    python bench/proc_timeline.py OUT.json [--every 0.5] -- COMMAND...

Runs COMMAND, samples /proc every ``--every`` seconds until it exits, writes
``{"command", "started_at", "ended_at", "rc", "procs": {pid: {"ppid", "cmd", "first_seen",
"created", "samples": [[t, cpu_s], ...]}}}`` (times in epoch seconds; ``created`` from the
process's start time in /proc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def boot_time() -> float:
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith("btime"):
                return float(line.split()[1])
    return 0.0


def snapshot(boot: float) -> dict[int, tuple]:
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
        except OSError:
            continue
        ppid, utime, stime, start = int(fields[1]), int(fields[11]), int(fields[12]), int(fields[19])
        out[int(name)] = (ppid, cmd, (utime + stime) / TICKS, boot + start / TICKS)
    return out


def main() -> int:
    argv = sys.argv[1:]
    every = 0.5
    if "--every" in argv:
        i = argv.index("--every")
        every = float(argv[i + 1])
        del argv[i:i + 2]
    out, cmd = argv[0], argv[argv.index("--") + 1:]
    boot = boot_time()
    before = set(snapshot(boot))
    started = time.time()
    child = subprocess.Popen(cmd)
    procs: dict[int, dict] = {}
    while True:
        now = time.time()
        for pid, (ppid, line, cpu, created) in snapshot(boot).items():
            if pid in before:
                continue
            entry = procs.setdefault(pid, {"ppid": ppid, "cmd": line, "first_seen": now, "created": created,
                                           "samples": []})
            entry["cmd"] = line or entry["cmd"]
            entry["samples"].append([round(now, 2), cpu])
        if child.poll() is not None:
            break
        time.sleep(every)
    with open(out, "w") as fh:
        json.dump({"command": cmd, "started_at": started, "ended_at": time.time(), "rc": child.returncode,
                   "procs": procs}, fh)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
