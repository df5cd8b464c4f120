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

import logging
import os
import threading
from multiprocessing import context as mp_context
from typing import Any

from llmbatch.engines.settings import EngineKwargs

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
        super().start()

    def run(self) -> None:
        env = getattr(self, "_parent_env", None)
        if env is not None:
            _init_titles()
            os.environ.clear()
            os.environ.update(env)
        super().run()


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
