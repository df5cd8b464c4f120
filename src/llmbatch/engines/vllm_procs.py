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
"""

from __future__ import annotations

import logging
import os
from multiprocessing import context as mp_context
from typing import Any

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


def wanted(engine_kwargs: dict[str, Any]) -> bool:
    """Whether this replica's engine process should come from the fork server: in a Ray actor,
    for a single-process engine, unless LLMBATCH_ENGINE_FORK_SERVER=0."""
    return os.environ.get("LLMBATCH_ENGINE_FORK_SERVER", "1") != "0" and single_process(engine_kwargs) and in_ray_actor()


def single_process(engine_kwargs: dict[str, Any]) -> bool:
    """Whether this engine runs in one engine process (what the fork server serves)."""
    return all(int(engine_kwargs.get(key) or 1) == 1
               for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))


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
