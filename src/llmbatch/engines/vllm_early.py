"""vLLM's engine launched by a job's driver as the job begins, before its replica exists.

A replica's engine starts only once Ray has started, Ray Data has placed the replica and the
replica has imported vLLM and built the engine's config: on an H200 its engine was ready at 47 s
where plain vLLM's was at 34 s (bench/RESULTS.md, "The engine's imports before the replica").
vLLM can run engines "managed externally" (its multi-API-server mode): ``launch_core_engines``
starts the engine and answers its handshake with ZMQ addresses the launcher picks, and
``AsyncLLM(client_addresses=...)`` attaches a front-end to them later.

So where a job's one replica will run on this machine, the driver hands the engine's spec to a
launcher process as the job begins (:func:`launch`; ``engines/vllm_launcher.py``): it imports vLLM,
builds the engine's arguments as the replica would (``engines.vllm_setup.start_kwargs``), launches
the engine and, once it is ready, writes how to attach (the addresses, the arguments, the engine's
processes) to a file. ``llmbatch run`` starts that launcher first thing (:func:`prewarm`), so that
vLLM's import runs beside the CLI's own imports and the job's config. The replica attaches where
the file's settings are its own (:func:`attach`; its front-end's config and tokenizer are built
while it waits, :func:`config_ahead`); otherwise, or where the launch failed, it stops that engine
and starts its own. The launcher lives as long as the driver holds its stdin: at the job's end (or
the driver's death) it stops the engine. The replica adopts the engine's processes into its reaper
and watches them: an engine that dies is a dead engine to the replica, which restarts its own.

Only for one single-process replica of a job, no warm engine (``keep_warm_s`` 0), no LoRA, no
placement group, Ray on this machine and at most one GPU here, and by default only on machines of
:data:`MIN_CPUS` or more CPUs: on one H200 host (16 cores) a 10,000-row job's first request came
7 s sooner with it, while on a 2-core laptop the launcher's vLLM import takes the cores Ray's
start needs (a 200-row job 34 s against 25 s). ``LLMBATCH_ENGINE_EARLY=1`` turns it on anywhere,
``0`` off.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from llmbatch.engines.settings import VLLMSettings
from llmbatch.errors import ConfigError
from llmbatch.reaper import TreeProgress, adopt, end_processes, with_descendants

logger = logging.getLogger(__name__)

ENV = "LLMBATCH_ENGINE_EARLY"
#: CPUs a machine needs for the engine to be launched early where ``LLMBATCH_ENGINE_EARLY`` is unset
MIN_CPUS = 8
#: the CLI commands that start a launcher before their imports (:func:`prewarm`)
PREWARM_COMMANDS = ("run", "resume", "retry-errors")
#: seconds a replica waits for the launcher's engine (while the launcher runs) before it starts its own
WAIT_S = float(os.environ.get("VLLM_ENGINE_READY_TIMEOUT_S", "600"))
#: seconds in which a launch that is not ready must use :data:`STALL_CPU_S` of CPU (the launcher
#: and its engine together), or the replica gives up on it: every step of a start (imports, config,
#: loading weights, compiling, the KV cache, CUDA graphs) uses CPU, a deadlocked one none
STALL_S = 120.0
STALL_CPU_S = 0.5


class Launch:
    """The driver's handle on one launched engine."""

    def __init__(self, proc: subprocess.Popen, attach_path: str, key: str, log_path: str):
        self.proc = proc
        self.attach_path = attach_path
        self.key = key
        self.log_path = log_path

    def info(self) -> dict[str, Any]:
        """What the replica needs to find and check the engine (it travels with the engine stage)."""
        return {"attach": self.attach_path, "key": self.key, "host": socket.gethostname(),
                "launcher": self.proc.pid, "log": self.log_path}

    def stop(self) -> None:
        """Tell the launcher the job ended (its stdin closes) without waiting for it: it stops the
        engine (a moment after, for the replica that attached) and removes its folder on its own."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass


#: this driver's launched engines, by their settings' key (a job's processor finds its own)
_launched: dict[str, Launch] = {}


def key_of(model_source: str, engine_kwargs: dict[str, Any], task_type: str) -> str:
    return json.dumps([model_source, dict(engine_kwargs), task_type], sort_keys=True, default=str)


def launch(settings: VLLMSettings) -> Launch | None:
    """In a job's driver, as the job begins: launch the engine of ``settings`` where its one
    replica could attach to it; None elsewhere. The caller has checked the job's side (one
    replica, no warm engine, no placement group, no LoRA, no engine metrics)."""
    if not _wanted(settings):
        return None
    key = key_of(settings.model_source, settings.engine_kwargs, settings.task_type)
    if key in _launched and _launched[key].proc.poll() is None:
        return _launched[key]
    global _prewarmed
    found, _prewarmed = _prewarmed, None
    if found is None or found.proc.poll() is not None:
        found = _spawn()
    if found is None:
        return None
    found.key = key
    spec = {"model_source": settings.model_source, "engine_kwargs": dict(settings.engine_kwargs),
            "task_type": settings.task_type, "detokenize_stage": settings.detokenize_stage,
            "attach": found.attach_path, "key": key}
    try:
        found.proc.stdin.write((json.dumps(spec, default=str) + "\n").encode())
        found.proc.stdin.flush()
    except (OSError, ValueError):
        logger.warning("could not launch the engine early; the replica starts it", exc_info=True)
        found.stop()
        return None
    _launched[key] = found
    return found


def prewarm(argv: list[str]) -> None:
    """In ``llmbatch run`` (and ``resume``, ``retry-errors``), before the CLI's own imports: start
    the launcher, which imports vLLM while the driver reads the job; :func:`launch` hands it the
    spec, and :func:`stop_all` ends it where the job needs no engine of its own."""
    global _prewarmed
    if (not argv or argv[0] not in PREWARM_COMMANDS or {"--help", "-h"} & set(argv) or _prewarmed is not None
            or os.environ.get("RAY_ADDRESS", "").strip() not in ("", "local")):
        return
    try:
        wanted = _enabled() and _one_device_here()
    except ConfigError:
        return  # the job's own check says what is wrong with the variable
    import importlib.util

    if wanted and importlib.util.find_spec("vllm") is not None:
        _prewarmed = _spawn()


#: a launcher started by :func:`prewarm`, waiting for its spec
_prewarmed: Launch | None = None


def _spawn() -> Launch | None:
    """A launcher process in a folder of its own, importing vLLM until its spec comes."""
    folder = tempfile.mkdtemp(prefix="llmbatch-engine-")
    log_path = os.path.join(folder, "engine.log")
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "llmbatch.engines.vllm_launcher", folder],
                                    stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True)
    except OSError:
        logger.warning("could not launch the engine early; the replica starts it", exc_info=True)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return Launch(proc, os.path.join(folder, "attach.json"), "", log_path)


def launched() -> dict[str, Any] | None:
    """In the driver, as the processor runs: the engine it launched (one a job), if its launcher
    still runs (the replica checks its settings, :func:`attach`)."""
    found = next((launch for launch in _launched.values() if launch.proc.poll() is None), None)
    return found.info() if found is not None else None


def stop_all() -> None:
    """In the driver, as the job ends: stop every engine it launched, and a launcher started
    for one that the job did not need."""
    global _prewarmed
    if _prewarmed is not None:
        _prewarmed.stop()
        _prewarmed = None
    while _launched:
        _, found = _launched.popitem()
        found.stop()


def _wanted(settings: VLLMSettings) -> bool:
    import importlib.util

    return (_enabled() and settings.max_replicas() == 1
            and settings.engine_kwargs.single_process() and not settings.engine_kwargs.get("enable_lora")
            and _one_device_here() and _ray_here() and importlib.util.find_spec("vllm") is not None)


def _enabled() -> bool:
    """``LLMBATCH_ENGINE_EARLY``: 1 on, 0 off; unset: on where this process may use
    :data:`MIN_CPUS` CPUs or more."""
    value = os.environ.get(ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise ConfigError(f"{ENV}={value!r}: use 1 (launch the engine early), 0 (never) or leave it unset "
                         f"(on machines of {MIN_CPUS} or more CPUs)")
    return len(os.sched_getaffinity(0)) >= MIN_CPUS


def _one_device_here() -> bool:
    """At most one GPU on this machine (the replica's is then the launcher's)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()]) <= 1
    return len(glob.glob("/dev/nvidia[0-9]*")) <= 1


def _ray_here() -> bool:
    """Whether the job's Ray is this machine alone (one it will start, or a local one)."""
    try:
        import ray

        if ray.is_initialized():
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            return len(nodes) == 1 and nodes[0].get("NodeID") == ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not known: not here
        return False
    address = os.environ.get("RAY_ADDRESS", "").strip()
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return address in ("", "local") or host in ("127.0.0.1", "localhost", "::1")


# -- in the replica ----------------------------------------------------------------------------

def on_this_machine(info: dict[str, Any] | None) -> bool:
    """Whether the driver launched an engine for this replica on this machine."""
    return bool(info) and info.get("host") == socket.gethostname()


def attach(info: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    """In the replica: how to attach to the engine the driver launched for it (``{"input_address",
    "output_address", "kwargs", "pids"}``), waiting for it while its launcher runs; None where
    there is none for this replica (another machine, a launch that failed or took longer than
    :data:`WAIT_S`, other settings than the replica's ``key``, more devices): an engine launched
    but not taken is stopped first, so that the replica's own has the device."""
    if not on_this_machine(info):
        return None
    if info.get("key") != key:
        logger.warning("the engine launched early has other settings than this replica's: it is stopped "
                       "and the replica starts its own")
        _end([info["launcher"]])
        return None
    deadline = time.monotonic() + WAIT_S
    path = info["attach"]
    progress = TreeProgress(info["launcher"], STALL_S, STALL_CPU_S)
    while not os.path.exists(path):
        if not _running(info["launcher"]):
            return None
        if time.monotonic() > deadline:
            logger.warning("the engine launched early was not ready after %.0f s: it is stopped and the "
                           "replica starts its own", WAIT_S)
            _end([info["launcher"]])
            return None
        if progress.stalled():
            logger.warning("the engine launched early made no progress in %.0f s (its processes used "
                           "under %.1f CPU-s; its log: %s): it is stopped and the replica starts its own",
                           STALL_S, STALL_CPU_S, info.get("log"))
            _end([info["launcher"]])
            return None
        time.sleep(0.05)
    with open(path) as fh:
        at = json.load(fh)
    if "error" in at:
        logger.warning("the engine launched early failed (%s; its log: %s); the replica starts its own",
                       at["error"], info.get("log"))
        return None
    if len([d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]) > 1:
        _end(at["pids"])  # this replica has more devices than the launcher's one
        return None
    return at


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _end(pids: list[int]) -> None:
    end_processes(with_descendants(pids), grace_s=5)


def watch(pids: list[int], on_death, closing: threading.Event) -> None:
    """Call ``on_death()`` once when one of ``pids`` (the attached engine's processes) ends,
    unless ``closing`` was set first (the replica stopped it)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass

    def alive(proc) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def wait() -> None:
        while not closing.is_set() and procs and all(alive(p) for p in procs):
            closing.wait(0.5)
        if not closing.is_set():
            on_death()

    threading.Thread(target=wait, name="llmbatch-engine-watch", daemon=True).start()


def config_ahead(info: dict[str, Any] | None, key: str, kwargs: dict[str, Any], usage_context: Any) -> Any:
    """In the replica, before it waits for the launched engine: the front-end's config (~1 s) and
    renderer (the tokenizer's load and copies: 1.1 s of the front-end's 1.25 s on this CPU) from its
    own arguments, for :func:`front_end` where the engine's are the same. None where no engine was
    launched for this replica, or the build fails (the start after reports why)."""
    if not on_this_machine(info) or info.get("key") != key:
        return None
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.renderers import renderer_from_config

    try:
        config = AsyncEngineArgs(**kwargs).create_engine_config(usage_context)
        return _same(kwargs), config, renderer_from_config(config)
    except Exception:  # noqa: BLE001 - built again after the wait, where its error is reported
        logger.debug("the front-end's config could not be built ahead", exc_info=True)
        return None


@contextlib.contextmanager
def renderer_given(ahead: Any):
    """While ``AsyncLLM`` is built, vLLM's ``renderer_from_config`` returns the renderer built ahead
    for that config (called by another name, the tokenizer vLLM cached is what is gained)."""
    from vllm.v1.engine import async_llm

    own = async_llm.__dict__.get("renderer_from_config")
    if ahead is None or own is None:
        yield
        return
    # (AsyncLLM's constructor does not await: nothing else runs on this loop while it is swapped)
    async_llm.renderer_from_config = lambda cfg, **kw: ahead[2] if cfg is ahead[1] and not kw else own(cfg, **kw)
    try:
        yield
    finally:
        async_llm.renderer_from_config = own


def _same(kwargs: dict[str, Any]) -> str:
    """The arguments the front-end uses (a CPU engine's KV cache bytes follow the free memory as each
    process looks: only the engine's workers read them)."""
    return json.dumps({k: v for k, v in kwargs.items() if k != "kv_cache_memory_bytes"}, sort_keys=True, default=str)


def front_end(args: Any, at: dict[str, Any], usage_context: Any, stat_loggers: list | None,
              ahead: Any = None) -> tuple[Any, Any]:
    """An ``AsyncLLM`` front-end on the engine the driver launched (``at``: :func:`attach`), and
    what stops that engine (the front-end's shutdown leaves processes it did not start). The
    replica adopts the engine's processes (they die with it) and watches them: one that dies makes
    the engine dead to the front-end, as vLLM's own watch does for the engines it starts."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    pids = list(at["pids"])
    for pid in pids:
        adopt(pid)
    if ahead is not None and ahead[0] != _same(at["kwargs"]):
        ahead[2].shutdown()  # built for other arguments than the engine's
        ahead = None
    config = ahead[1] if ahead is not None else args.create_engine_config(usage_context)
    try:
        with renderer_given(ahead):
            llm = AsyncLLM(vllm_config=config, executor_class=Executor.get_class(config),
                           log_stats=not args.disable_log_stats, usage_context=usage_context,
                           stat_loggers=stat_loggers, client_addresses={"input_address": at["input_address"],
                                                                        "output_address": at["output_address"]})
    except BaseException:
        _end(pids)
        raise
    closing = threading.Event()

    def dead() -> None:  # vLLM's monitor_engine_cores, for an engine it did not start
        client = getattr(llm, "engine_core", None)
        resources = getattr(client, "resources", None)
        if resources is not None:
            resources.engine_dead = True
        try:
            client.shutdown()
        except Exception:  # noqa: BLE001 - it is gone: the requests see a dead engine
            logger.debug("front-end shutdown after the engine died failed", exc_info=True)

    def detach() -> None:
        closing.set()
        _end(pids)

    watch(pids, dead, closing)
    return llm, detach
