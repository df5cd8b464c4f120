"""No engine process outlives its replica.

vLLM runs its engine in child processes of the replica. When Ray ends a replica abruptly
(the job's driver exits, a node is drained, ``ray stop``), those children are not told: they
keep their memory (and, on a GPU, the GPU) until someone kills them. :func:`watch_children`
starts a small reaper process, outside the replica's process group, that holds one end of a
pipe whose other end only the replica holds: when the replica dies, for whatever reason, the
pipe closes and the reaper kills the processes the replica had started. A process another
process started for the replica (vLLM's engine process, forked by the driver's fork server:
``engines/vllm_procs.py``) is handed to the reaper through the same pipe (:func:`adopt`).
:class:`TreeProgress` tells a process tree that starts an engine from one that hangs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

#: How often the reaper refreshes the list of the replica's descendants
#: (``LLMBATCH_REAPER_REFRESH_S`` sets it: a test that kills a replica seconds after it started
#: its children sets it short).
REFRESH_S = float(os.environ.get("LLMBATCH_REAPER_REFRESH_S", "2.0"))


_WRITE_FD: int | None = None
#: processes this one asked another to start, handed to its reaper (:func:`adopt`): psutil
#: processes (each knows when it started, so a later process with its PID is not taken for it)
_ADOPTED: list = []


def watch_children() -> bool:
    """Start the reaper for this process once; returns whether it runs. The reaper detaches
    (a new session, and not a child of this process) so that whatever ends this process and
    its direct children leaves it to do its work."""
    global _WRITE_FD
    if _WRITE_FD is not None:
        return True
    read_fd, write_fd = os.pipe()
    try:
        # run as a file, not `-m llmbatch.reaper`: that imports the llmbatch package first (Ray
        # Data and more: seconds, more on a loaded machine, where the wait below can run out
        # and leave the replica unwatched); the reaper itself needs only the standard library
        launcher = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), str(read_fd)],
                                    pass_fds=(read_fd,), start_new_session=True, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        launcher.wait(timeout=30)  # it forks the reaper and exits at once
    except (OSError, subprocess.TimeoutExpired):
        os.close(write_fd)
        return False
    finally:
        os.close(read_fd)
    os.set_inheritable(write_fd, False)  # only this process holds it: its death closes the pipe
    _WRITE_FD = write_fd
    return True


def adopt(pid: int) -> None:
    """End ``pid`` (and its descendants) with this process's children when this process dies,
    though it is no descendant of this process; counted in :func:`family` too."""
    import psutil

    try:
        _ADOPTED.append(psutil.Process(pid))
    except psutil.Error:
        return  # it ended already
    if _WRITE_FD is not None:
        try:
            os.write(_WRITE_FD, b"%d\n" % pid)
        except OSError:  # the reaper is gone: nothing watches this process's children either
            pass


def family() -> list:
    """This process, its descendants and the processes it adopted with theirs (psutil
    processes): what it holds of its machine."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    _ADOPTED[:] = [p for p in _ADOPTED if p.is_running()]
    for adopted in _ADOPTED:
        try:
            procs += [adopted, *adopted.children(recursive=True)]
        except psutil.Error:
            continue
    return procs


def _descendants(pid: int) -> dict[int, object]:
    """The process's descendants now, as psutil process objects (each remembers when its
    process started, so it never stands for a later process that got the same PID)."""
    import psutil

    try:
        return {p.pid: p for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {}


def victims(known: dict[int, object]) -> list:
    """The processes to end: those of ``known`` still running (the same processes, not PIDs
    reused since) and their own descendants."""
    import psutil

    out = []
    for proc in known.values():
        try:
            if not proc.is_running():  # gone, or its PID now names another process
                continue
            out.append(proc)
            out.extend(proc.children(recursive=True))
        except psutil.Error:
            continue
    return out


def _reap(watched: int, read_fd: int) -> None:
    import select

    import psutil

    known: dict[int, object] = {}
    adopted: dict[int, object] = {}
    pending = b""
    while True:
        ready, _, _ = select.select([read_fd], [], [], REFRESH_S)
        if ready:
            data = os.read(read_fd, 4096)
            if not data:
                break  # the replica is gone (or exited): its pipe end closed
            *lines, pending = (pending + data).split(b"\n")  # adopted PIDs, one per line
            for line in lines:
                try:
                    adopted[int(line)] = psutil.Process(int(line))
                except (ValueError, psutil.Error):
                    continue
        known.update(_descendants(watched))
        for proc in adopted.values():
            known[proc.pid] = proc
            known.update(_descendants(proc.pid))
        known = {pid: p for pid, p in known.items() if p.is_running()}
        adopted = {pid: p for pid, p in adopted.items() if p.is_running()}
    end_processes(victims(known), grace_s=3)


def with_descendants(pids: list[int]) -> list:
    """The psutil processes of ``pids`` and their descendants (found now), children first, each
    once (a pid may be another's descendant: an engine's launcher and its engine); pids already
    gone are left out."""
    import psutil

    procs: dict = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for child in proc.children(recursive=True):
                procs.setdefault(child.pid, child)
            procs.setdefault(pid, proc)
        except psutil.Error:
            continue
    return list(procs.values())


def end_processes(procs: list, grace_s: float) -> None:
    """SIGTERM each of ``procs`` (psutil processes), then SIGKILL those alive after ``grace_s``
    and wait up to ``grace_s`` more for them (our own children are reaped, not left zombies)."""
    import psutil

    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def processes_naming(text: str) -> list:
    """The processes whose command line contains ``text`` (e.g. a Ray cluster's temp dir)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if text in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


class TreeProgress:
    """Whether a process and its descendants make progress while something waits for them: their
    CPU time (user and system), sampled every few seconds, grew at least ``min_cpu_s`` over the
    last ``window_s`` (a start that imports, loads, compiles or allocates uses CPU; a deadlocked
    one uses none)."""

    def __init__(self, pid: int, window_s: float, min_cpu_s: float):
        self.pid, self.window_s, self.min_cpu_s = pid, window_s, min_cpu_s
        self.samples: list[tuple[float, float]] = []

    def stalled(self) -> bool:
        now = time.monotonic()
        if self.samples and now - self.samples[-1][0] < min(5.0, self.window_s / 4):
            return False
        self.samples.append((now, self.cpu_s()))
        old = [s for s in self.samples if now - s[0] >= self.window_s]
        if not old:
            return False
        self.samples = self.samples[len(old) - 1:]  # from the newest sample a whole window old
        return self.samples[-1][1] - old[-1][1] < self.min_cpu_s

    def cpu_s(self) -> float:
        import psutil

        total = 0.0
        for proc in with_descendants([self.pid]):
            try:
                times = proc.cpu_times()  # (with the children it reaped: their time stays counted)
                total += times.user + times.system + times.children_user + times.children_system
            except psutil.Error:
                pass
        return total


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))  # run as a file: its folder (llmbatch's) leaves the path
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    if os.fork() > 0:  # the launcher exits; the reaper is nobody's child
        os._exit(0)
    _reap(int(sys.argv[1]), int(sys.argv[2]))
