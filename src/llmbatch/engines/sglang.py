"""SGLang behind the engine base class: one ``sglang.Engine`` per replica (GPU only).

The engine runs its scheduler (the GPU) and detokenizer in child processes of the replica,
and takes requests on the replica's asyncio loop (``Engine.async_generate``), so many are in
flight and each row leaves as soon as its answer is done.

Differences from SGLang used as is (and from Ray's SGLang stage):

- SGLang's own watchdog answers a dead child process with SIGQUIT to the replica, which
  ends it (outside the main thread nothing handles the signal). llmbatch stops that watchdog
  and watches the engine's processes itself: a dead engine fails its in-flight rows with
  :class:`SGLangEngineDead`, and the engine stage restarts it and retries them.
- ``Engine.shutdown`` kills every child of the process; :meth:`SGLangEngine.close` kills
  only the engine's own processes (and waits until they are gone, so the GPU is free).
- The tokenizer stays in the engine (``skip_tokenizer_init=False``): SGLang's constrained
  decoding and stop strings need it. Rows still arrive as token ids, so nothing is tokenized
  twice; set ``engine_kwargs.skip_tokenizer_init=True`` for token-in, token-out.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import itertools
import logging
import os
import sys
import time
from typing import Any

from llmbatch import startlog
from llmbatch.engines.base import Engine, Request
from llmbatch.engines.logs import EngineLog
from llmbatch.engines.settings import SGLangSettings
from llmbatch.engines.sglang_params import output_columns, sampling_params
from llmbatch.engines.vllm_params import request_digest
from llmbatch.engines.vllm_setup import one_line
from llmbatch.errors import EngineStartError, MissingDependencyError, ResourceError, RowValidationError, suggestion
from llmbatch.models import resolve_model
from llmbatch.reaper import end_processes, watch_children, with_descendants
from llmbatch.rows import OPENAI, Row, to_python

logger = logging.getLogger(__name__)

PIP_EXTRA = "llmbatch[sglang]"
#: Requests admitted to one engine when neither the user nor the started engine says how many.
DEFAULT_CAPACITY = 1024
#: How often the engine's processes are checked for life, and how long they get to exit.
POLL_S = 0.5
SHUTDOWN_TIMEOUT_S = 10.0
CAPACITY_QUERY_S = 30.0  # seconds the started engine gets to say how many it runs at once
#: SGLang arguments llmbatch sets itself (the model comes from ``model_source``).
OWN_ARGS = ("model_path", "model")


class SGLangEngineDead(RuntimeError):
    """An SGLang engine process (scheduler or detokenizer) died; the engine must restart."""


NO_GPU = ("the SGLang engine needs a CUDA GPU and this machine has none (SGLang has no CPU build); "
          "run it on a GPU machine, or use vLLMEngineProcessorConfig here (pip install \"llmbatch[cpu]\")")


def missing_sglang() -> MissingDependencyError:
    return MissingDependencyError("SGLangEngineProcessorConfig (the SGLang engine, GPU only)", PIP_EXTRA,
                                  f'pip install "{PIP_EXTRA}" (on a machine with a CUDA GPU)')


def import_sglang():
    """The ``sglang`` package, or :class:`MissingDependencyError` with the pip command."""
    try:
        import sglang
    except ImportError as exc:
        raise missing_sglang() from exc
    return sglang


def has_gpu() -> bool:
    """Whether this machine has a CUDA GPU that torch sees (asked through NVML where torch can,
    so this process starts no CUDA runtime of its own)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
    except Exception:  # noqa: BLE001 - no torch or no driver: no GPU
        return False


def require_gpu() -> None:
    """SGLang has no CPU build: fail with the reason in a replica without a CUDA GPU."""
    if not has_gpu():
        raise EngineStartError(NO_GPU)


def check_sglang_build() -> None:
    """At build time, before any work: SGLang is installed, and, when the run stays on this
    machine (no Ray cluster to connect to), this machine has a GPU. On a cluster the
    processor checks the cluster's GPUs when it runs, and each replica its own."""
    if importlib.util.find_spec("sglang") is None:
        raise missing_sglang()
    ray = sys.modules.get("ray")
    on_cluster = bool(os.environ.get("RAY_ADDRESS")) or (ray is not None and ray.is_initialized())
    if not on_cluster and not has_gpu():
        raise ResourceError(NO_GPU)


def engine_arguments(model_path: str, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments for ``sglang.Engine`` (its ``ServerArgs``)."""
    kwargs = dict(engine_kwargs)
    for key in OWN_ARGS:
        kwargs.pop(key, None)
    kwargs.pop("task_type", None)
    kwargs.setdefault("log_level", "error")
    kwargs.setdefault("skip_tokenizer_init", False)
    return {"model_path": model_path, **kwargs}


def check_engine_kwargs(kwargs: dict[str, Any], known: list[str]) -> None:
    """Unknown SGLang arguments fail before the engine starts, with the closest known name."""
    for key in kwargs:
        if key not in known:
            raise EngineStartError(f"engine_kwargs: '{key}' is not an sglang.Engine argument{suggestion(key, known)}")


class SGLangEngine(Engine):
    """One ``sglang.Engine`` with llmbatch's request building and output shaping."""

    def __init__(self, settings: SGLangSettings):
        if settings.task_type != "generate":
            raise ValueError("the SGLang engine runs task_type='generate' only")
        self.settings = settings
        self.model_source = settings.model_source
        self.engine = None
        self.capacity = DEFAULT_CAPACITY
        self.context_len: int | None = None
        self.tokenizer_in_engine = not settings.engine_kwargs.skip_tokenizer_init
        self.log: EngineLog | None = None
        #: the engine's own processes (schedulers, detokenizer): watched for life
        self.pids: list[int] = []
        #: every process this engine started directly: killed (with their children) on close
        self._started: list[int] = []
        self._ids = itertools.count()
        self._dead: asyncio.Future | None = None
        self._monitor: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.log = self.log or EngineLog()
        watch_children()  # the engine's processes never outlive this replica
        with startlog.timed("sglang-engine", model=self.model_source), self.log.capture():
            self._start()
        self._dead = asyncio.get_running_loop().create_future()
        self._monitor = asyncio.ensure_future(self._watch())
        await self._read_capacity()

    async def _read_capacity(self) -> None:
        """The requests the engine runs at once, as its scheduler sized them from the KV cache
        (2,048-4,096 on a large GPU): the main process's ``server_args`` says None."""
        if getattr(self.engine.server_args, "max_running_requests", None):
            return  # the user's figure: _start took it from server_args
        try:
            states = await asyncio.wait_for(self.engine.tokenizer_manager.get_internal_state(), CAPACITY_QUERY_S)
            running = sum(int(s.get("effective_max_running_requests_per_dp") or 0) for s in states)
        except Exception as exc:  # noqa: BLE001 - an older SGLang, or no answer: keep the default
            logger.warning("SGLang did not say how many requests it runs at once (%s: %s); admitting %d",
                           type(exc).__name__, exc, self.capacity)
            return
        if running > 0:
            self.capacity = running

    def _start(self) -> None:
        before = set(_children(recursive=False))
        try:
            engine = self._launch()
        except Exception:
            _kill(sorted(set(_children(recursive=False)) - before))  # a half-started engine's processes
            raise
        atexit.unregister(engine.shutdown)  # its shutdown kills every child of this process
        manager = engine.tokenizer_manager
        watchdog = getattr(manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # it would SIGQUIT this replica when a child dies; _watch restarts instead
        self.engine = engine
        self.pids = sorted(engine.get_all_child_pids())
        self._started = sorted(set(self.pids) | (set(_children(recursive=False)) - before))
        self.context_len = int(getattr(manager, "context_len", 0) or 0) or None
        self.capacity = int(getattr(engine.server_args, "max_running_requests", None) or DEFAULT_CAPACITY)

    def _launch(self):
        """A started ``sglang.Engine`` (its scheduler and detokenizer processes are up)."""
        sglang = import_sglang()
        require_gpu()
        from sglang.srt.server_args import ServerArgs

        self.model_path = resolve_model(self.model_source)
        kwargs = engine_arguments(self.model_path, self.settings.engine_kwargs)
        check_engine_kwargs(kwargs, list(ServerArgs.__dataclass_fields__))
        try:
            return sglang.Engine(**kwargs)
        except Exception as exc:  # noqa: BLE001 - the engine's own reason is the message
            raise EngineStartError(f"SGLang could not start model '{self.model_source}' ({self.model_path}): "
                                   f"{one_line(exc)} (the engine's full log: {self.log.path})") from exc

    async def _watch(self) -> None:
        """Fail in-flight requests when an engine process dies (SGLang's requests would wait forever)."""
        import psutil

        while True:
            await asyncio.sleep(POLL_S)
            gone = [pid for pid in self.pids if not _alive(pid, psutil)]
            if gone and self._dead is not None and not self._dead.done():
                self._dead.set_exception(SGLangEngineDead(f"SGLang engine process {gone[0]} exited"))
                self._dead.exception()  # retrieved: each request re-raises it itself
                return

    async def restart(self) -> None:
        await self.close()
        await self.start()

    async def close(self) -> None:
        """Stop the engine: its asyncio tasks on this loop, then its processes (killed and
        waited for, so the GPU is free when this returns)."""
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        if self.engine is None:
            return
        engine, self.engine = self.engine, None
        manager = engine.tokenizer_manager
        for task in list(getattr(manager, "asyncio_tasks", ()) or ()):
            task.cancel()
        try:
            if getattr(engine, "send_to_rpc", None) is not None:
                engine.send_to_rpc.close(linger=0)
        except Exception:  # noqa: BLE001 - a dead engine's socket may already be gone
            logger.debug("closing the SGLang rpc socket failed", exc_info=True)
        await asyncio.get_running_loop().run_in_executor(None, _kill, self._started)
        self.pids, self._started = [], []

    def is_fatal(self, exc: BaseException) -> bool:
        return isinstance(exc, SGLangEngineDead) or (self._dead is not None and self._dead.done())

    # -- requests ----------------------------------------------------------------------------

    def build_request(self, row: Row) -> Request:
        if row.get(OPENAI):
            raise RowValidationError("OpenAI Batch requests are not supported by the SGLang engine yet; "
                                     "use vLLMEngineProcessorConfig")
        if row.get("multimodal_data"):
            raise RowValidationError("images, video and audio are not supported by llmbatch's SGLang engine yet")
        adapter = row.get("model")
        if adapter is not None and adapter not in (self.model_source, getattr(self, "model_path", None)):
            raise RowValidationError(f"the row names LoRA adapter {adapter!r}; the SGLang engine runs no adapters "
                                     "in llmbatch yet (use vLLMEngineProcessorConfig)")
        ids = row.get("tokenized_prompt")
        text = row.get("prompt")
        if ids is None and not (isinstance(text, str) and text.strip()):
            raise RowValidationError("the row has neither 'tokenized_prompt' nor a non-empty 'prompt'")
        if ids is not None:
            ids = [int(t) for t in to_python(ids)]
            if not ids:
                raise RowValidationError("'tokenized_prompt' is empty")
        elif not self.tokenizer_in_engine:
            raise RowValidationError("the row has only a text 'prompt' but the engine runs with skip_tokenizer_init=True "
                                     "(no tokenizer); keep the tokenize stage on")
        params, structured = sampling_params(row.get("sampling_params"), self.context_len, self.tokenizer_in_engine)
        deterministic = params.get("temperature", 1.0) == 0 or params.get("sampling_seed") is not None
        body = ids if ids is not None else text
        key = request_digest(body, params, None) if deterministic else None
        sort_key = ("", 0, tuple(ids), "") if ids is not None else ("", 1, (), text)
        prompt = {"input_ids": ids} if ids is not None else {"prompt": text}
        return Request(prompt=prompt, params=params, key=key, sort_key=sort_key,
                       extra={"prompt": text if isinstance(text, str) else "", "structured": structured})

    async def run(self, request: Request) -> dict[str, Any]:
        if self.engine is None or self._dead is None:
            raise SGLangEngineDead("the SGLang engine is not running")
        if self._dead.done():
            raise self._dead.exception()
        request_id = next(self._ids)
        rid = f"llmbatch-{os.getpid()}-{request_id}"
        start = time.perf_counter()
        call = asyncio.ensure_future(self.engine.async_generate(sampling_params=dict(request.params), rid=rid,
                                                                **request.prompt))
        try:
            await asyncio.wait({call, self._dead}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            call.cancel()
            self._abort(rid)
            raise
        if not call.done():
            call.cancel()
            raise self._dead.exception()
        out = call.result()
        result = output_columns(out, request.prompt.get("input_ids"))
        result.update(prompt=request.extra.get("prompt") or "", time_taken_llm=time.perf_counter() - start,
                      request_id=request_id)
        return result

    def _abort(self, rid: str) -> None:
        """Tell the engine to drop a request nobody waits for any more."""
        try:
            self.engine.tokenizer_manager.abort_request(rid)
        except Exception:  # noqa: BLE001 - best effort: the engine may be gone
            logger.debug("abort of %s failed", rid, exc_info=True)


def _children(recursive: bool) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process().children(recursive=recursive)]
    except psutil.Error:
        return []


def _alive(pid: int, psutil: Any) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(pids: list[int], timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Terminate ``pids`` and their descendants (found now: a scheduler's compile workers), then
    kill what is left after ``timeout``."""
    end_processes(with_descendants(pids), grace_s=timeout)
