"""A replica that dies abruptly takes its engine processes with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

REPLICA = '''
import subprocess, sys, time
from llmbatch.reaper import watch_children
assert watch_children()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
grandchild = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print(p.pid, flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
print(child.pid, grandchild.stdout.readline().strip(), flush=True)
time.sleep(600)
'''


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split()[2] != "Z"


def test_children_of_a_killed_process_are_reaped():
    replica = subprocess.Popen([sys.executable, "-c", REPLICA], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in replica.stdout.readline().split()]
    time.sleep(2.5)  # the reaper has seen them
    assert all(alive(p) for p in pids)
    os.kill(replica.pid, signal.SIGKILL)  # as Ray ends a worker: no cleanup runs in it
    replica.wait()
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)
