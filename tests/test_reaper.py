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


def kill_replica_and_wait_for_its_children(code: str) -> list[int]:
    """Run ``code`` as a replica, SIGKILL it once the reaper has seen its children; returns
    the children still alive 15 s later."""
    # the reaper looks every 0.2 s: by the kill it has looked a dozen times, however loaded the
    # machine (at its 2 s default it could miss children 2.5 s old: seen with the suite running)
    replica = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "LLMBATCH_REAPER_REFRESH_S": "0.2"})
    pids = [int(p) for p in replica.stdout.readline().split()]
    time.sleep(2.5)  # the reaper has seen them
    assert all(alive(p) for p in pids)
    os.kill(replica.pid, signal.SIGKILL)  # as Ray ends a worker: no cleanup runs in it
    replica.wait()
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_children_of_a_killed_process_are_reaped():
    assert kill_replica_and_wait_for_its_children(REPLICA) == []


def test_the_reaper_starts_without_importing_the_llmbatch_package(tmp_path):
    """The reaper runs as a file: `python -m llmbatch.reaper` imported the whole package (Ray
    Data and more), which on a loaded machine can outlast the launch's bound and leave the
    replica unwatched. Here an llmbatch that cannot import comes first on the reaper's path."""
    shim = tmp_path / "shim" / "llmbatch"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('the reaper imported the llmbatch package')\n")
    replica = REPLICA.replace("assert watch_children()",
                              f"import os; os.environ['PYTHONPATH'] = {str(shim.parent)!r}; assert watch_children()")
    assert kill_replica_and_wait_for_its_children(replica) == []


def test_the_reaper_never_ends_a_process_that_reused_a_pid():
    """The reaper keeps process objects, not PIDs: one whose PID now names another process
    (here: an object from before the PID was reused, faked by its start time) is left alone."""
    import psutil

    from llmbatch.reaper import victims

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        fresh = psutil.Process(child.pid)
        stale = psutil.Process(child.pid)
        stale._ident = (child.pid, stale._ident[1] - 1000.0)  # the process that had this PID before
        assert victims({child.pid: stale}) == []
        assert [p.pid for p in victims({child.pid: fresh})] == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_ending_a_process_tree_ends_its_descendants_and_leaves_no_zombie():
    """``end_processes(with_descendants(pids))`` (how the SGLang engine closes its processes):
    the process and its child end, and our own child is reaped, not left a zombie."""
    from llmbatch.reaper import end_processes, with_descendants

    parent = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(p.pid, flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())
    # a pid that is another's descendant (a launcher and its engine) is listed once, children first
    assert [p.pid for p in with_descendants([grandchild, parent.pid, grandchild])] == [grandchild, parent.pid]
    end_processes(with_descendants([parent.pid]), grace_s=10)
    assert not alive(parent.pid) and not os.path.exists(f"/proc/{parent.pid}")
    assert not alive(grandchild)
