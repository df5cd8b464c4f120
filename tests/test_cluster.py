"""Ray's start on a thread of its own (``cluster.RayStart``), begun beside a job's preparation."""

import threading

import pytest

from llmbatch import cluster, startlog


def test_ray_starts_on_another_thread_and_wait_returns_once_it_is_up(monkeypatch):
    calls = []
    release = threading.Event()

    def fake_ensure_ray(**kwargs):
        calls.append((threading.current_thread().name, kwargs))
        assert release.wait(10), "the test never let the start finish"

    monkeypatch.setattr(cluster, "ensure_ray", fake_ensure_ray)
    start = cluster.RayStart(log_to_driver=False)
    assert start.ready_at is None  # the caller goes on while Ray starts
    release.set()
    marks = start.wait()
    assert calls == [("llmbatch-ray-start", {"log_to_driver": False})]
    assert start.ready_at is not None and start.ready_at >= start.began
    assert marks == {"ray_began": start.began, "ray_up": start.ready_at}  # the run's phases read them


def test_a_failed_start_is_raised_where_the_caller_waits_for_ray(monkeypatch):
    def failing(**_kwargs):
        raise ConnectionError("could not reach the GCS at 10.0.0.1:6379")

    monkeypatch.setattr(cluster, "ensure_ray", failing)
    start = cluster.RayStart()
    with pytest.raises(ConnectionError, match="10.0.0.1:6379"):
        start.wait()
    assert start.ready_at is None


def test_an_abandoned_start_stops_the_ray_it_began_and_only_that(monkeypatch):
    import ray

    stopped = []
    monkeypatch.setattr(ray, "init", lambda **_kwargs: None)  # ensure_ray decides; no Ray starts
    monkeypatch.delenv(startlog.ENV, raising=False)  # nor is one counted in the suite's ledger
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(True))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cluster.RayStart().abandon()  # a local cluster this start began: stopped
    assert stopped == [True]
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setattr(cluster, "check_reachable", lambda _address: None)  # as if a head listened there
    start = cluster.RayStart()
    start.abandon()  # joined through an address: stays
    assert start.wait() and not start.began_local
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    cluster.RayStart().abandon()  # up before (a notebook's own ray.init): stays
    assert stopped == [True]


def test_a_mistake_found_in_a_large_input_stops_the_ray_started_beside_its_read(tmp_path, monkeypatch):
    """A large input's read runs beside Ray's start; when the read finds a mistake (here: no
    column the prompt names), the job fails with it and the start it began is abandoned, not left
    running."""
    from llmbatch.errors import ConfigError
    from llmbatch.jobs import run as run_module
    from llmbatch.jobs.spec import JobSpec

    starts = []

    class Recorded:
        def __init__(self, **kwargs):
            self.kwargs, self.abandoned = kwargs, False
            starts.append(self)

        def abandon(self):
            self.abandoned = True

    monkeypatch.setattr(run_module, "RayStart", Recorded)
    monkeypatch.setenv(run_module.LONG_READ_ENV, "0")  # as for a large input
    (tmp_path / "in.csv").write_text("Index,Company\n1,Acme\n")
    spec = JobSpec.model_validate({"input": {"path": str(tmp_path / "in.csv")},
                                   "model": {"source": "smollm2-135m-instruct"},
                                   "prompt": {"user": "{Company} in {Cityy}"},
                                   "output": {"path": str(tmp_path / "out.parquet")}})
    with pytest.raises(ConfigError, match="Cityy"):
        run_module.run_job(spec, quiet=True)
    assert len(starts) == 1 and starts[0].abandoned and starts[0].kwargs == {"log_to_driver": False}
    monkeypatch.setenv(run_module.LONG_READ_ENV, str(10**9))  # a small input: no Ray before the rows need it
    with pytest.raises(ConfigError, match="Cityy"):
        run_module.run_job(spec, quiet=True)
    assert len(starts) == 1


def test_a_local_ray_started_on_the_thread_outlives_the_start(tmp_path):
    """Ray starts its GCS and raylet with PR_SET_PDEATHSIG: they die when the thread that started
    them ends. A real local Ray, in a fresh process (no cluster to join): after the start the
    thread is still there and Ray still runs a task. Its TMPDIR is deep (a scheduler's per-job
    scratch): Ray keeps its sessions under it, and its sockets there were past the 107 bytes a
    socket's path may have ("AF_UNIX path length cannot exceed 107 bytes"); Ray now starts in /tmp."""
    import os
    import subprocess
    import sys

    code = (
        "import threading, ray\n"
        "from llmbatch.cluster import RayStart\n"
        "start = RayStart(num_cpus=1)\n"
        "start.wait()\n"
        "assert start.began_local\n"
        "assert [t for t in threading.enumerate() if t.name == 'llmbatch-ray-start' and t.is_alive()]\n"
        "print('answer', ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=120))\n"
        "start.abandon()\n"
    )
    deep = tmp_path / ("scratch-" + "d" * 60)
    deep.mkdir()
    assert len(str(deep / "ray")) + cluster.RAY_SOCKET_NAME_LEN > 107  # too long for Ray's own choice
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")} | {"TMPDIR": str(deep)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "answer 42" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_a_temp_dir_too_long_for_sockets_gets_a_short_one_and_a_short_one_is_kept(monkeypatch, tmp_path):
    """Where Ray's and vLLM's sockets go (``env.socket_dir``): their default folder where its
    path leaves room for their names, else /tmp; and the folder a local Ray is started with."""
    import ray

    from llmbatch.env import socket_dir

    assert socket_dir("/tmp/ray", cluster.RAY_SOCKET_NAME_LEN, "Ray's") is None
    assert socket_dir("/" + "d" * 70, 37, "vLLM's IPC") == "/tmp"
    assert socket_dir("/" + "d" * 69, 37, "vLLM's IPC") is None  # 70 + 37 = 107 bytes: fits
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(kwargs))  # ensure_ray decides; no Ray starts
    monkeypatch.delenv(startlog.ENV, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / ("d" * 60)))
    cluster.ensure_ray()
    monkeypatch.setenv("TMPDIR", "/var/tmp")
    cluster.ensure_ray()
    monkeypatch.setenv("RAY_TMPDIR", "/" + "r" * 60)  # the user's own choice is Ray's to take (or refuse)
    assert cluster.ray_temp_dir() == "/" + "r" * 60 + "/ray"
    cluster.ensure_ray()
    cluster.ensure_ray(_temp_dir="/mine")
    assert [k.get("_temp_dir") for k in seen] == ["/tmp/ray", None, None, "/mine"]


def test_a_size_for_ray_beside_the_read_that_is_no_number_fails_naming_the_variable(tmp_path, monkeypatch):
    from llmbatch.errors import ConfigError
    from llmbatch.jobs import run as run_module

    (tmp_path / "in.csv").write_text("Index,Company\n1,Acme\n")
    monkeypatch.setenv(run_module.LONG_READ_ENV, "16MiB")
    with pytest.raises(ConfigError, match="LLMBATCH_RAY_BESIDE_INPUT_BYTES='16MiB' is not a whole number of bytes"):
        run_module._long_read(str(tmp_path / "in.csv"))


@pytest.mark.parametrize("address", ["10.0.0.9:6379", None])
def test_a_ray_that_cannot_start_or_be_joined_fails_with_its_reason_and_what_to_do(monkeypatch, address):
    """Ray's own start-up waits bound ray.init (its GCS connection, the raylet); what it raises
    reaches the user as one llmbatch error naming the cluster and the fix, not a traceback."""
    import ray

    from llmbatch.errors import ResourceError

    def failing_init(**_kwargs):
        raise ConnectionError("Failed to connect to GCS within 60 seconds. GCS may have been killed.\nmore lines")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", failing_init)
    monkeypatch.delenv(startlog.ENV, raising=False)  # no Ray starts: none counted in the suite's ledger
    monkeypatch.setattr(cluster, "check_reachable", lambda _address: None)  # Ray's join is what fails here
    if address:
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ResourceError) as caught:
        cluster.ensure_ray()
    said = str(caught.value)
    assert "Failed to connect to GCS within 60 seconds" in said and "more lines" not in said, said
    if address:
        assert f"could not join the Ray cluster at {address} (RAY_ADDRESS)" in said and "unset RAY_ADDRESS" in said
    else:
        assert "Ray could not start on this machine" in said and "ray start --head" in said
    assert isinstance(caught.value.__cause__, ConnectionError)


def test_an_address_where_nothing_listens_fails_at_once_instead_of_ray_retrying_without_end(monkeypatch):
    """A real socket: nothing listens at the port; Ray's own join would retry for minutes. The
    join fails within the set wait, naming the address and the variable, and Ray is not started."""
    import socket
    import time

    import ray

    from llmbatch.errors import ResourceError

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **_kwargs: pytest.fail("ray.init ran for an address nobody listens at"))
    monkeypatch.delenv(startlog.ENV, raising=False)
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setenv(cluster.JOIN_TIMEOUT_ENV, "1")
    began = time.monotonic()
    with pytest.raises(ResourceError) as caught:
        cluster.ensure_ray()
    assert time.monotonic() - began < 30
    said = str(caught.value)
    assert f"could not join the Ray cluster at 127.0.0.1:{port} (RAY_ADDRESS)" in said, said
    assert "nothing accepted a connection there within 1 s" in said and cluster.JOIN_TIMEOUT_ENV in said, said
    monkeypatch.setenv(cluster.JOIN_TIMEOUT_ENV, "soon")
    with pytest.raises(Exception, match="LLMBATCH_RAY_JOIN_TIMEOUT_S='soon' is not a number of seconds"):
        cluster.ensure_ray()


def test_an_address_that_accepts_connections_is_left_to_ray(monkeypatch):
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        cluster.check_reachable(f"127.0.0.1:{listener.getsockname()[1]}")  # returns: Ray's to join
        cluster.check_reachable(f"ray://127.0.0.1:{listener.getsockname()[1]}")
    cluster.check_reachable("auto")  # Ray resolves these itself
    cluster.check_reachable("local")
