"""The process that launches a job's vLLM engine for its replica (``engines/vllm_early.py``).

It begins importing vLLM as soon as it starts, before it knows which engine: the job's driver
starts it first thing (``llmbatch run``, before the CLI's own imports; ``vllm_early.prewarm``) and
sends the engine's spec as the first line on its stdin once the job's config is read. Then it
builds the engine's arguments as the replica would (``engines.vllm_setup.start_kwargs``), launches
the engine and, once it is ready, writes how to attach (the addresses, the arguments, the
engine's processes) to the spec's file. It lives as long as its stdin is open: the driver closes
it at the job's end (or dies), and then it stops the engine. A stdin closed before any spec (the
job needed no engine of its own) ends it at once, even in the middle of its imports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from llmbatch import startlog
from llmbatch.engines.settings import VLLMSettings
from llmbatch.engines.vllm_setup import engine_env, start_kwargs

logger = logging.getLogger(__name__)

#: seconds the launcher leaves its engine to the replica after the job ended, before it stops it
RELEASE_S = 10.0


class Stdin:
    """The driver's side of the conversation: the spec (the first line), then the end (EOF)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.spec: dict[str, Any] | None = None
        self.spec_at = 0.0  # when the spec came (epoch s)
        self.has_spec = threading.Event()
        self.ended = threading.Event()
        threading.Thread(target=self._read, name="llmbatch-launcher-stdin", daemon=True).start()

    def _read(self) -> None:
        # The file descriptor itself, never ``sys.stdin``: a thread blocked in a read of Python's
        # stdin holds its buffer's lock, and a process forked meanwhile (vLLM forks the engine on a
        # GPU) inherits it held: the child's first step closes its stdin (multiprocessing's
        # ``_close_stdin``) and waits for that lock for ever.
        fd = sys.stdin.fileno()
        data = b""
        while b"\n" not in data:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
        line = data.split(b"\n", 1)[0]
        if not line.strip():  # closed before a spec: no engine is wanted; stop even mid-import
            shutil.rmtree(self.folder, ignore_errors=True)
            os._exit(0)
        self.spec = json.loads(line)
        self.spec_at = time.time()
        self.has_spec.set()
        while os.read(fd, 1 << 16):
            pass
        self.ended.set()


def _import_vllm() -> None:
    """What the launch needs of vLLM: the slow part of a start, done before the spec is known."""
    engine_env()
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.usage.usage_lib  # noqa: F401
    import vllm.v1.engine.utils  # noqa: F401
    import vllm.v1.executor  # noqa: F401


@contextlib.contextmanager
def core_engines(config: Any, executor: Any, log_stats: bool) -> Iterator[tuple[Any, Any]]:
    """vLLM's ``launch_core_engines`` on ZMQ addresses of ours where it takes them (vLLM 0.32;
    older ones make them and yield them): ``(manager, addresses)`` once the engine's processes
    are started, before it is ready; the exit waits for its ready message."""
    import inspect

    from vllm.v1.engine import utils as engine_utils

    if "addresses" in inspect.signature(engine_utils.launch_core_engines).parameters:
        addresses = engine_utils.EngineZmqAddresses(inputs=[_ipc_path()], outputs=[_ipc_path()])
        launching = engine_utils.launch_core_engines(config, executor, log_stats, addresses)
    else:
        launching = engine_utils.launch_core_engines(config, executor, log_stats)
    with launching as launched:
        if isinstance(launched, tuple):  # (manager, coordinator, addresses[, tensor queue]: vLLM 0.26)
            yield launched[0], launched[2]
        else:
            yield launched.engine_manager, launched.addresses


def _launch_engine(spec: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """Start the engine of ``spec`` as the replica would and wait until it is ready: its
    manager (its processes), the addresses a front-end attaches to, the engine's arguments."""
    settings = VLLMSettings(model_source=spec["model_source"], engine_kwargs=spec["engine_kwargs"],
                            task_type=spec["task_type"], detokenize_stage=spec["detokenize_stage"])
    _, kwargs = start_kwargs(settings)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor import Executor

    args = AsyncEngineArgs(**kwargs)
    config = args.create_engine_config(UsageContext.LLM_CLASS)
    if config.model_config.multimodal_config is not None:
        # media travel from the front-end to the engine by ways it sets up as it starts (vLLM's
        # tensor queue): a front-end attached later has none of them
        raise NotImplementedError("a multimodal model's engine starts in its replica")
    executor = Executor.get_class(config)
    log_stats = not args.disable_log_stats  # as the replica's front-end will say (AsyncLLM.from_engine_args)
    # (the context's exit waits for the engine's ready message; where the start fails, it stops
    # the engine's processes and raises)
    with core_engines(config, executor, log_stats) as (manager, addresses):
        pass
    return manager, addresses, kwargs


def main(folder: str) -> None:
    began = time.time()
    stdin = Stdin(folder)
    try:
        _import_vllm()
        imported = None
    except BaseException as exc:  # noqa: BLE001 - reported in the attach file once the spec says where
        imported = exc
    imported_s = round(time.time() - began, 3)
    stdin.has_spec.wait()
    spec = stdin.spec
    assert spec is not None
    attach_path = spec["attach"]

    def write(payload: dict[str, Any]) -> None:
        with open(attach_path + ".tmp", "w") as fh:
            json.dump(payload, fh)
        os.replace(attach_path + ".tmp", attach_path)

    try:
        # the start counts from this process's start: its vLLM import is the start's first step
        with startlog.timed("vllm-engine", since=began, model=spec["model_source"], task=spec["task_type"],
                            engine_kwargs=spec["engine_kwargs"], launched_early=True,
                            imported_s=imported_s, spec_after_s=round(stdin.spec_at - began, 3)):
            if imported is not None:
                raise imported
            manager, addresses, kwargs = _launch_engine(spec)
    except BaseException as exc:  # noqa: BLE001 - the replica starts its own and reports its own error
        logger.exception("the engine could not be launched early")
        write({"error": f"{type(exc).__name__}: {exc}"})  # (the replica reads it, then starts its own)
        stdin.ended.wait()
        with contextlib.suppress(OSError):  # the folder and its log (the traceback) stay: the replica's warning names them
            os.remove(attach_path)
        return
    # the engine is ready: the replica's front-end binds these and the engine connects to them
    write({"input_address": addresses.inputs[0], "output_address": addresses.outputs[0], "kwargs": kwargs,
           "pids": [p.pid for p in manager.processes]})
    # Until the driver closes stdin (its job ended) or dies. The replica that attached owns the
    # engine by then (it stops it as it closes; its reaper ends it if it dies): it gets a moment
    # to do so before this process stops what is left.
    stdin.ended.wait()
    deadline = time.monotonic() + RELEASE_S
    while any(p.is_alive() for p in manager.processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    _shutdown(manager)
    shutil.rmtree(folder, ignore_errors=True)


def _shutdown(manager: Any) -> None:
    stop = getattr(manager, "shutdown", None) or getattr(manager, "close")  # vLLM 0.32: shutdown
    stop()


def _ipc_path() -> str:
    try:
        from vllm.utils.network_utils import get_open_zmq_ipc_path
    except ImportError:  # older vLLM
        from vllm.utils import get_open_zmq_ipc_path
    return get_open_zmq_ipc_path()


if __name__ == "__main__":
    main(sys.argv[1])
