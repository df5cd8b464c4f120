"""vLLM's engine process, started from a warm fork server instead of a fresh interpreter.

In a Ray actor (every llmbatch replica) vLLM must not fork its engine process from the actor
(a Ray worker's threads and connections do not survive a fork), so it spawns one: a fresh
Python that imports torch and vLLM again, after the replica has imported them once. On an H100
that second import is 19 s of every engine start (the replica's log: engine process spawned
at 22:43:47, initialising at 22:44:06), on this 2-core CPU about as long.

Here the replica starts a multiprocessing fork server as its engine start begins. The server
imports vLLM's engine modules while the replica imports its own, side by side, and vLLM's
engine process is then forked from the server, already imported: the same state as plain
``vllm.LLM``, which forks its engine process from a process that has imported vLLM. The
engine process gets the environment the replica has when it starts it (vLLM sets variables
around that moment), not the server's.

Only for a single-process engine (no tensor, pipeline or data parallelism: those start their
workers through Ray or with settings this does not reproduce); anything unexpected falls back
to vLLM's own spawn.

With the server, the engine process also starts before the front-end is built
(:func:`async_llm_engine_first`): ``AsyncLLM`` loads its tokenizer and the model's processor
and builds its input processor first and only then starts its engine process, 4-11 s on an
H100 with Qwen2.5-VL (the replica's logs: the model's config resolved, then the engine process
initialising) in which the engine could already be loading its model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
from multiprocessing import context as mp_context
from typing import Any

from llmbatch import reaper
from llmbatch.engines.settings import EngineKwargs
from llmbatch.engines.vllm_setup import ENGINE_ENV

logger = logging.getLogger(__name__)

#: What the fork server imports before it forks anything: vLLM's engine process and executors.
PRELOAD = ("vllm", "vllm.v1.engine.core", "vllm.v1.executor.abstract", "vllm.v1.executor.uniproc_executor",
           "vllm.v1.executor.multiproc_executor")


#: whether the user set VLLM_WORKER_MULTIPROC_METHOD (read when the server starts, before vLLM
#: forces "spawn" on the replica for itself)
_user_method_set = False


class _EnvForkServerProcess(mp_context.ForkServerProcess):
    """A fork-server process that runs with the environment its parent had at ``start()``
    (less the "spawn" vLLM forces on a Ray actor: the engine process is no Ray actor, and
    forks its own workers as under plain vLLM)."""

    def start(self) -> None:
        env = dict(os.environ)
        if not _user_method_set:
            env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
        self._parent_env = env
        self._parent_cwd = os.getcwd()
        self._parent_std = _StdFds()
        super().start()
        if _joined is not None:  # forked by the driver's server: no child of this process
            reaper.adopt(self.pid)

    def run(self) -> None:
        env = getattr(self, "_parent_env", None)
        if env is not None:
            _init_titles()
            os.environ.clear()
            os.environ.update(env)
            self._parent_std.attach()
            try:
                os.chdir(self._parent_cwd)
            except OSError:
                pass  # the server's folder: a model path is absolute by now (resolve_model)
        super().run()


class _StdFds:
    """The starting process's stdout and stderr, handed to the process it starts through the
    fork server (a server's child otherwise writes where the server does: the driver's
    terminal, where the driver started it)."""

    def __init__(self, fds: tuple[int, int] | None = None):
        self.fds = fds

    def __reduce__(self):
        popen = mp_context.get_spawning_popen()  # set while the process object is pickled
        if popen is None or not hasattr(popen, "duplicate_for_child"):
            return (_StdFds, ())
        return (_received_std, (popen.DupFd(popen.duplicate_for_child(1)), popen.DupFd(popen.duplicate_for_child(2))))

    def attach(self) -> None:
        if self.fds is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in zip(self.fds, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)


def _received_std(out: Any, err: Any) -> _StdFds:
    return _StdFds((out.detach(), err.detach()))


def _init_titles() -> None:
    """setproctitle (vLLM names its processes ``VLLM::EngineCore`` with it) finds the memory it
    writes titles to through the environment block the process started with: it must look
    before the environment changes, else titles silently stay unset."""
    try:
        import setproctitle

        setproctitle.getproctitle()
    except Exception:  # noqa: BLE001 - no titles; nothing else depends on it
        pass


class _EnvForkServerContext(mp_context.ForkServerContext):
    Process = _EnvForkServerProcess


_CONTEXT = _EnvForkServerContext()

#: one engine-first start at a time in a process (:func:`async_llm_engine_first`)
_ENGINE_FIRST = threading.Lock()


def wanted(engine_kwargs: EngineKwargs) -> bool:
    """Whether this replica's engine process should come from the fork server: in a Ray actor,
    for a single-process engine, unless LLMBATCH_ENGINE_FORK_SERVER=0."""
    return (os.environ.get("LLMBATCH_ENGINE_FORK_SERVER", "1") != "0" and engine_kwargs.single_process()
            and in_ray_actor())


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor (where vLLM would spawn its engine process)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - no Ray: vLLM forks, nothing to do
        return False


def start_server() -> bool:
    """Start the fork server (it imports vLLM in the background); returns whether it runs."""
    global _user_method_set
    _user_method_set = "VLLM_WORKER_MULTIPROC_METHOD" in os.environ
    try:
        _CONTEXT.set_forkserver_preload(list(PRELOAD))
        from multiprocessing import forkserver

        forkserver.ensure_running()
        return True
    except Exception:  # noqa: BLE001 - vLLM's spawn still works
        logger.warning("could not start the engine fork server; vLLM spawns its engine process", exc_info=True)
        return False


#: The fewest CPUs on which the driver starts the fork server (:func:`serve_replicas`): its
#: imports then run beside Ray's start on cores Ray's start leaves idle. On 2 cores they take
#: cores from Ray's start instead, and the replica's own server already imports beside the
#: replica: a 16-row job took 23.9 s with the driver's server against 23.0 s without, three
#: runs each (bench/RESULTS.md, "The engine's imports before the replica").
DRIVER_SERVER_MIN_CPUS = 8

#: the driver's server, once started (:func:`serve_replicas`): where it listens, for the replicas
_driver: dict[str, Any] | None = None
_driver_proc: subprocess.Popen | None = None
_driver_lock = threading.Lock()
#: the write end of the pipe whose EOF ends the driver's server (only this process holds it)
_driver_alive_fd: int | None = None
#: the driver's server this replica forks its engine processes from (:func:`join_server`)
_joined: str | None = None


def serve_replicas(engine_kwargs: EngineKwargs) -> dict[str, Any] | None:
    """In the driver, as a run begins: start this process's fork server for its replicas on this
    machine (once: it lives as long as this process, idle between runs) and return where it
    listens, or None where no replica could use it: the fork server is off
    (``LLMBATCH_ENGINE_FORK_SERVER=0``) or the replicas' own (``=replica``), the engine is not
    single-process, this process is a Ray
    worker itself, vLLM is not installed here, Ray runs (or will run) on other machines, or
    this machine has fewer than :data:`DRIVER_SERVER_MIN_CPUS` CPUs (``=driver`` starts it
    anyway)."""
    global _driver, _driver_proc
    mode = os.environ.get("LLMBATCH_ENGINE_FORK_SERVER", "1").strip().lower()
    if mode in ("0", "replica") or (mode != "driver" and (os.cpu_count() or 1) < DRIVER_SERVER_MIN_CPUS):
        return None
    if (not engine_kwargs.single_process() or in_ray_actor() or importlib.util.find_spec("vllm") is None
            or not _ray_on_this_machine()):
        return None
    with _driver_lock:
        if _driver_proc is not None and _driver_proc.poll() is None:
            return _driver
        try:
            _driver_proc, _driver = _launch_server()
        except Exception:  # noqa: BLE001 - each replica starts its own, as without it
            logger.warning("could not start the engine fork server for the replicas", exc_info=True)
            _driver_proc = _driver = None
        return _driver


def _ray_on_this_machine() -> bool:
    """Whether Ray's nodes are this machine only (the one that is running, else the one that
    ``ray.init`` will start or join here)."""
    try:
        import ray

        if ray.is_initialized():
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            return len(nodes) == 1 and nodes[0].get("NodeID") == ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not known: no server
        return False
    address = os.environ.get("RAY_ADDRESS", "").strip()
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return address in ("", "local") or host in ("127.0.0.1", "localhost", "::1")


def _launch_server() -> tuple[subprocess.Popen, dict[str, Any]]:
    """multiprocessing's fork server (its ``main``, the protocol every client speaks), started in
    a session of its own (a Ctrl-C at the terminal is the driver's to handle, not the engine's)
    with its output in a file, vLLM's environment defaults and this process's ``sys.path``. It
    exits when this process does (the read end of a pipe only this process writes to)."""
    from multiprocessing import connection

    log_path = os.path.join(tempfile.gettempdir(), f"llmbatch-forkserver-{os.getpid()}.log")
    env = {**ENGINE_ENV, **os.environ}
    with socket.socket(socket.AF_UNIX) as listener, open(log_path, "ab") as log:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        try:
            code = (f"from multiprocessing.forkserver import main; "
                    f"main({listener.fileno()}, {alive_r}, {list(PRELOAD)!r}, sys_path={sys.path!r})")
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(listener.fileno(), alive_r),
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                    start_new_session=True)
        except BaseException:
            os.close(alive_w)
            raise
        finally:
            os.close(alive_r)
    global _driver_alive_fd
    if _driver_alive_fd is not None:  # a server before this one, gone
        os.close(_driver_alive_fd)
    _driver_alive_fd = alive_w  # held, never written: the server's EOF when this process ends
    return proc, {"address": address, "pid": proc.pid, "host": socket.gethostname(), "log": log_path}


def join_server(at: dict[str, Any] | None) -> bool:
    """In a replica: fork this process's engine processes from the driver's server ``at``
    (:func:`serve_replicas`) where it runs on this machine; returns whether it will."""
    global _joined
    if not at or at.get("host") != socket.gethostname() or not _serving(at):
        return False
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_address is not None:  # this process runs (or joined) one already
            return server._forkserver_address == at["address"]
        server._forkserver_address = at["address"]
        # sent to each child as its own server's "alive" end; nothing reads it here
        server._forkserver_alive_fd = os.open(os.devnull, os.O_WRONLY)
        # the server is no child of this process: nothing to wait for or restart here
        server.ensure_running = resource_tracker.ensure_running
    global _user_method_set
    _user_method_set = "VLLM_WORKER_MULTIPROC_METHOD" in os.environ
    _joined = at["address"]
    return True


def _serving(at: dict[str, Any]) -> bool:
    """Whether the fork server ``at`` still runs (its process, not a later one with its PID, and
    its socket)."""
    try:
        with open(f"/proc/{int(at['pid'])}/cmdline", "rb") as fh:
            if b"multiprocessing.forkserver" not in fh.read():
                return False
        return os.path.exists(at["address"])
    except (OSError, KeyError, TypeError, ValueError):
        return False


def use_server() -> bool:
    """Make vLLM start its engine process from the fork server; returns whether it will."""
    try:
        import vllm.v1.engine.utils as engine_utils
    except ImportError:
        return False
    if not callable(getattr(engine_utils, "get_mp_context", None)):
        return False
    engine_utils.get_mp_context = lambda: _CONTEXT
    return True


def async_llm_engine_first(engine_args: Any, usage_context: Any, stat_loggers: list | None) -> Any:
    """``AsyncLLM.from_engine_args(engine_args, usage_context=..., stat_loggers=...)``, with the
    engine process started first: its client (the engine's start and vLLM's handshake with it)
    is built on a thread while ``AsyncLLM`` builds its front-end, and ``AsyncLLM`` is handed that
    client where it would start one. Only with the fork server (:func:`use_server`): a forked
    engine process must not come from this process while another of its threads runs."""
    # only what the engine's start needs: the front-end's own modules are imported beside it
    from vllm.transformers_utils.config import maybe_register_config_serialize_by_value
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.executor import Executor
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    vllm_config = engine_args.create_engine_config(usage_context)
    executor_class = Executor.get_class(vllm_config)
    log_stats = not engine_args.disable_log_stats
    client_log_stats = log_stats or bool(stat_loggers) or bool(load_stat_logger_plugin_factories())
    maybe_register_config_serialize_by_value()  # as AsyncLLM does first: the config travels to the engine
    launched: dict[str, Any] = {}

    def launch() -> None:
        try:
            launched["client"] = EngineCoreClient.make_async_mp_client(
                vllm_config=vllm_config, executor_class=executor_class, log_stats=client_log_stats)
        except BaseException as exc:  # noqa: BLE001 - raised where AsyncLLM asks for the client
            launched["error"] = exc

    def started_client(*_args: Any, **kwargs: Any) -> Any:
        thread.join()  # bounded by vLLM's own wait for its engine (VLLM_ENGINE_READY_TIMEOUT_S)
        if "error" in launched:
            raise launched.pop("error")
        client = launched.pop("client")
        renderer = kwargs.get("renderer")  # vLLM >= 0.32: its front-end multimodal warm-up
        if renderer is not None and getattr(client, "_renderer", False) is None:
            client._renderer = renderer
            client._start_mm_warmup()
        return client

    thread = threading.Thread(target=launch, name="llmbatch-engine-start", daemon=True)
    with _ENGINE_FIRST:  # vLLM's client factory is swapped for this start's client while it runs
        thread.start()
        own = EngineCoreClient.__dict__["make_async_mp_client"]
        EngineCoreClient.make_async_mp_client = staticmethod(started_client)
        try:
            from vllm.v1.engine import async_llm

            return async_llm.AsyncLLM(vllm_config=vllm_config, executor_class=executor_class,
                                      log_requests=engine_args.enable_log_requests, log_stats=log_stats,
                                      usage_context=usage_context, stat_loggers=stat_loggers)
        except BaseException:
            thread.join()  # the front-end failed before it took the engine: stop the engine too
            client = launched.pop("client", None)
            if client is not None:
                client.shutdown()
            raise
        finally:
            EngineCoreClient.make_async_mp_client = own
