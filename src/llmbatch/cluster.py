"""Ray start-up and cluster checks.

On a laptop Ray starts itself (``ray.init()`` with local resources); on a cluster the same
code joins it through ``RAY_ADDRESS``. Requests the cluster can never satisfy fail here, at
once, instead of leaving the job pending forever.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from llmbatch import startlog
from llmbatch.env import env_number, socket_dir
from llmbatch.errors import ResourceError

logger = logging.getLogger(__name__)

#: Seconds a cluster's address gets to accept a connection before joining it fails (its head
#: may still be starting); ``LLMBATCH_RAY_JOIN_TIMEOUT_S`` sets another.
JOIN_TIMEOUT_S = 30.0
JOIN_TIMEOUT_ENV = "LLMBATCH_RAY_JOIN_TIMEOUT_S"
#: The longest socket path below a local Ray's temp folder: "/session_<date>_<time>_<us>_<pid>/sockets/plasma_store".
RAY_SOCKET_NAME_LEN = 64


def ensure_ray(**init_kwargs) -> bool:
    """Start or join Ray if this process has not yet; returns whether this call started a
    local Ray (not up before, no address to join)."""
    import ray

    if ray.is_initialized():
        return False
    # Ray's start-up notices (token authentication, the local instance) stay in its log files
    kwargs = {"ignore_reinit_error": True, "include_dashboard": False, "logging_level": logging.ERROR}
    kwargs.update(init_kwargs)
    if os.environ.get("RAY_ADDRESS"):
        kwargs.pop("num_cpus", None)
        kwargs.pop("num_gpus", None)
    # ray.init makes SIGTERM sys.exit(15) in the driver; a handler of the process's own (run_job's:
    # stop cleanly, as Ctrl-C does) stays
    own = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    address = kwargs.get("address") or os.environ.get("RAY_ADDRESS")
    joined = bool(address)
    if not joined and "_temp_dir" not in kwargs and not os.environ.get("RAY_TMPDIR"):  # (the user's is kept)
        short = socket_dir(ray_temp_dir(), RAY_SOCKET_NAME_LEN, "Ray's")
        if short is not None:
            kwargs["_temp_dir"] = os.path.join(short, "ray")
    with startlog.timed("ray-init", joined=joined):
        if address:
            check_reachable(address)
        try:
            ray.init(**kwargs)
        except Exception as exc:  # noqa: BLE001 - Ray's own reason, with what to do about it
            reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise ResourceError(ray_start_failed(reason, address, kwargs.get("_temp_dir"))) from exc
    if callable(own):
        signal.signal(signal.SIGTERM, own)
    return not joined


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError(raw)
    return value


def check_reachable(address: str) -> None:
    """Fail, naming the address, where nothing accepts a connection at a cluster's ``host:port``
    (``ray://host:port`` too) within :data:`JOIN_TIMEOUT_S`: Ray's own join retries an
    unreachable address without end (a mistyped ``RAY_ADDRESS`` waited over two minutes, still
    retrying). ``auto`` and ``local`` are Ray's to resolve."""
    timeout_s = env_number(JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S, _seconds, "a number of seconds above 0", "60")
    target = address.strip().removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ResourceError(ray_start_failed(
                    f"nothing accepted a connection there within {timeout_s:g} s ({exc}; "
                    f"{JOIN_TIMEOUT_ENV} sets the wait)", address)) from exc
        time.sleep(0.5)


def ray_temp_dir() -> str:
    """The folder a local Ray keeps its sessions in, by Ray's rule: ``RAY_TMPDIR``, else (on
    Linux) ``TMPDIR``, else /tmp; then ``ray``."""
    base = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None)
    return os.path.join(base or "/tmp", "ray")


def ray_start_failed(reason: str, address: str | None, temp_dir: str | None = None) -> str:
    """What a failed start or join of Ray says: the reason, and what to do."""
    if address:
        return (f"could not join the Ray cluster at {address} (RAY_ADDRESS): {reason}. Check that the "
                "cluster's head is up and reachable from this machine (`ray status` there), or unset "
                "RAY_ADDRESS to run on this machine alone")
    logs = os.path.join(temp_dir or ray_temp_dir(), "session_latest", "logs")
    return (f"Ray could not start on this machine: {reason}. Ray's logs are in {logs}; a machine short of memory, "
            "of /tmp space or of CPU starts Ray slowly: free some and run again, or start Ray yourself "
            "(`ray start --head`) and set RAY_ADDRESS=auto")


class RayStart:
    """:func:`ensure_ray` on a thread of its own, begun where the caller still has work that
    needs no Ray (a job's lock, its input's first read, its state): Ray's start (its GCS, raylet
    and workers: 2-3 s on a laptop, 7-9 s on a many-core GPU node) runs beside that work instead
    of after it. :meth:`wait` returns once Ray is up, or raises what its start raised; Ray's own
    start-up waits bound it (as the direct call).

    The thread stays (idle) once Ray is up: Ray starts its GCS and raylet with
    ``PR_SET_PDEATHSIG``, and Linux kills such a child when the *thread* that started it ends,
    not only its process (the job's driver then loses its object store: "The connection to the
    plasma store is failed. Terminate the process")."""

    def __init__(self, **init_kwargs: Any):
        self.began = time.time()
        self.ready_at: float | None = None
        self._error: BaseException | None = None
        self.began_local = False  # this start began a local Ray (abandon stops it)
        self._kwargs = init_kwargs
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._start, name="llmbatch-ray-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            self.began_local = ensure_ray(**self._kwargs)
            self.ready_at = time.time()
        except BaseException as exc:  # noqa: BLE001 - raised where the caller waits for Ray
            self._error = exc
        finally:
            self._done.set()
        if self._error is None and self.began_local:
            threading.Event().wait()  # Ray's processes live as long as this thread (see the class)

    def wait(self) -> dict[str, float | None]:
        """Wait for Ray; returns when its start began and ended (a run's ``ray_began``/``ray_up``)."""
        self._done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return {"ray_began": self.began, "ray_up": self.ready_at}

    def abandon(self) -> None:
        """The caller stopped before it needed Ray (a mistake found in the input, Ctrl-C): wait
        for the start to end, then stop the Ray this start began, so that no half-started
        cluster outlives the process. Ray that was up before, or joined through an address,
        stays."""
        self._done.wait()
        if self._error is None and self.began_local:
            import ray

            ray.shutdown()


def check_accelerator(accelerator_type: str, cluster: dict[str, float]) -> None:
    """Fail fast when no node has ``accelerator_type``."""
    key = f"accelerator_type:{accelerator_type}"
    if cluster.get(key, 0) > 0:
        return
    available = sorted(k.split(":", 1)[1] for k in cluster if k.startswith("accelerator_type:"))
    have = ", ".join(available) if available else "none (this cluster has no GPUs)" if not cluster.get("GPU") else "none labelled"
    raise ResourceError(
        f"accelerator_type={accelerator_type!r} is not available on this Ray cluster (accelerator types here: "
        f"{have}). Remove accelerator_type to run on what this machine has, or start the job on a cluster "
        f"with {accelerator_type} nodes."
    )
