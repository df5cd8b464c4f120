"""The driver's fork server (engines/vllm_procs.py): a replica on the same machine forks its
engine process from it as its own would, and nothing it starts outlives who started it.

These run multiprocessing's fork server with a light preload (``json`` for vLLM's modules) and
a process target from the standard library, so the protocol is real and no engine starts:
``tests/engines/test_vllm_setup.py`` forks a real vLLM engine from the driver's server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from llmbatch.engines import vllm_procs
from llmbatch.engines.settings import EngineKwargs

DRIVER = '''
import json, sys
from llmbatch.engines import vllm_procs
from llmbatch.engines.settings import EngineKwargs
vllm_procs.PRELOAD = ("json",)
print(json.dumps(vllm_procs.serve_replicas(EngineKwargs({}))), flush=True)
sys.stdin.readline()  # lives until the test lets it end
'''

#: a replica: joins the driver's server, then starts two processes through it (vLLM's engine
#: process in the real thing): one reports what it got and exits, one sleeps
REPLICA = '''
import json, os, sys
from llmbatch import reaper
from llmbatch.engines import vllm_procs
at, folder, err_path, out_path = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
assert reaper.watch_children()
assert vllm_procs.join_server(at)
os.environ["LLMBATCH_TEST_MARK"] = "the replica's"
os.chdir(folder)
err = open(err_path, "w")
os.dup2(err.fileno(), 2)
report = ("import json, os, sys; print('the engine process writes here', file=sys.stderr, flush=True); "
          f"json.dump(dict(ppid=os.getppid(), cwd=os.getcwd(), mark=os.environ.get('LLMBATCH_TEST_MARK'), "
          f"stderr=os.readlink('/proc/self/fd/2')), open({out_path!r}, 'w'))")
first = vllm_procs._CONTEXT.Process(target=exec, args=(report,))
first.start()
first.join(60)
sleeper = vllm_procs._CONTEXT.Process(target=exec, args=("import time; time.sleep(600)",))
sleeper.start()
print(json.dumps(dict(exitcode=first.exitcode, sleeper=sleeper.pid,
                      family=[p.pid for p in reaper.family()])), flush=True)
sys.stdin.readline()
'''


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def test_a_replica_forks_from_the_driver_s_server_as_from_its_own(tmp_path):
    env = {**os.environ, "LLMBATCH_ENGINE_FORK_SERVER": "driver", "LLMBATCH_REAPER_REFRESH_S": "0.2"}
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    replica = None
    try:
        at = json.loads(driver.stdout.readline())
        assert at and at["pid"] != driver.pid, at
        assert vllm_procs._serving(at), "the driver's server is not running"
        folder = tmp_path / "replica's folder"
        folder.mkdir()
        err, out = tmp_path / "replica-stderr.log", tmp_path / "report.json"
        replica = subprocess.Popen([sys.executable, "-c", REPLICA, json.dumps(at), str(folder), str(err), str(out)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        seen = json.loads(replica.stdout.readline())
        got = json.loads(out.read_text())
        checks = {
            "forked by the driver's server": got["ppid"] == at["pid"],
            "its exit code came back through the server": seen["exitcode"] == 0,
            "the replica's working directory": got["cwd"] == str(folder),
            "the replica's environment": got["mark"] == "the replica's",
            "the replica's stderr": got["stderr"] == str(err),
            "its output in the replica's log": "the engine process writes here" in err.read_text(),
            "counted in the replica's family": seen["sleeper"] in seen["family"],
        }
        assert all(checks.values()), ({k: v for k, v in checks.items() if not v}, got, seen, at)
        os.kill(replica.pid, signal.SIGKILL)  # as Ray ends a replica: its reaper ends what it adopted
        replica.wait()
        assert wait_gone(seen["sleeper"], 15), "an engine process forked for a killed replica outlived it"
    finally:
        if replica is not None and replica.poll() is None:
            replica.kill()
            replica.wait()
        driver.stdin.close()  # the driver ends: its server follows
        driver.wait(timeout=60)
    assert wait_gone(at["pid"], 30), "the driver's fork server outlived its driver"
    assert not vllm_procs._serving(at)


def test_a_replica_joins_only_a_live_server_on_its_own_machine():
    assert not vllm_procs.join_server(None)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not vllm_procs.join_server({"address": "/nonexistent/listener", "pid": int(gone.stdout),
                                       "host": os.uname().nodename})
    assert not vllm_procs.join_server({"address": "/tmp", "pid": os.getpid(), "host": "another-machine"})


def test_the_driver_starts_no_server_where_no_replica_could_use_it(monkeypatch):
    import ray

    monkeypatch.setattr(vllm_procs, "_driver_proc", None)
    monkeypatch.setattr(vllm_procs, "_launch_server", lambda: (_ for _ in ()).throw(AssertionError("started")))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for mode in ("0", "replica"):  # off, or each replica its own
        monkeypatch.setenv("LLMBATCH_ENGINE_FORK_SERVER", mode)
        assert vllm_procs.serve_replicas(EngineKwargs({})) is None, mode
    monkeypatch.setenv("LLMBATCH_ENGINE_FORK_SERVER", "1")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # its imports would take cores from Ray's start
    assert vllm_procs.serve_replicas(EngineKwargs({})) is None
    monkeypatch.setenv("LLMBATCH_ENGINE_FORK_SERVER", "driver")
    assert vllm_procs.serve_replicas(EngineKwargs({"tensor_parallel_size": 2})) is None  # Ray's own workers
    for address in ("10.1.2.3:6379", "ray://head.example:10001", "auto"):  # other machines (or maybe)
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert vllm_procs.serve_replicas(EngineKwargs({})) is None, address
    for address in ("", "local", "127.0.0.1:6379", "ray://localhost:10001"):
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert vllm_procs._ray_on_this_machine(), address
