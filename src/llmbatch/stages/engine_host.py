"""The engine host: the detached Ray actor that keeps one engine loaded between runs.

See :mod:`llmbatch.stages.warm` for what warm engines are and how replicas lease hosts. A host
serves one lease at a time: the lessee's chain of stages (its engine stage adopting the host's
engine, started with the first lease), rows streamed through it batch by batch, the lease
handed to the next run when the lessee dies or idles, the engine stopped after ``keep_warm_s``
idle seconds or when another run needs the room.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from llmbatch import startlog
from llmbatch.reaper import family
from llmbatch.rows import Row
from llmbatch.stages.base import Stage
from llmbatch.stages.engine import EngineStage
from llmbatch.stages.runner import run_stages

logger = logging.getLogger(__name__)

#: How long a lease waits for a busy host (a batch in it, or one a moment ago) before it looks
#: for another host.
HANDOVER_WAIT_S = 10.0
#: A host whose lessee sent it no batch for this long goes to the next run that asks for it.
TAKEOVER_IDLE_S = 3.0
#: How often a host looks at its lessee (alive?), its idle time and its machine's memory.
WATCH_EVERY_S = 2.0
#: An idle host stops when its machine has less than this share of its memory available, the
#: least used host first: each waits :data:`WATCH_EVERY_S` per lease it has served (at most
#: :data:`LOW_MEMORY_PATIENCE_LEASES` of them) for the memory to come back before it stops, so
#: the hosts of one-off settings make the room and the engine most runs use stays loaded.
LOW_MEMORY_FRACTION = 0.2
LOW_MEMORY_PATIENCE_LEASES = 15


def short_of_memory(fraction: float) -> bool:
    """Whether this machine has less than ``fraction`` of its memory available."""
    return memory_shortfall(fraction) > 0


def memory_shortfall(fraction: float) -> int:
    """Bytes this machine lacks to have ``fraction`` of its memory available (0: none)."""
    import psutil

    memory = psutil.virtual_memory()
    return max(0, int(fraction * memory.total - memory.available))


def stops_for_memory(short_for_s: float, leases: int) -> bool:
    """Whether an idle host that has served ``leases`` leases stops, its machine short of
    memory for ``short_for_s`` seconds (:data:`LOW_MEMORY_FRACTION`)."""
    return short_for_s >= WATCH_EVERY_S * min(leases, LOW_MEMORY_PATIENCE_LEASES)


def tree_memory() -> int:
    """Bytes this process, its children and the processes it adopted (an engine process the
    driver's fork server forked for it) hold alone (USS; RSS where the system gives no USS):
    what stopping it gives back to its machine."""
    import psutil

    total = 0
    for proc in family():
        try:
            try:
                total += proc.memory_full_info().uss
            except (psutil.AccessDenied, AttributeError):
                total += proc.memory_info().rss
        except psutil.Error:
            continue  # gone since it was listed
    return total


class LeaseLost(RuntimeError):
    """The host was leased to another run (this replica's lessee looked dead)."""


class EngineHost:
    """The detached actor that keeps one engine loaded between runs (module docstring)."""

    def __init__(self, key: str, keep_warm_s: float, low_memory_fraction: float = LOW_MEMORY_FRACTION):
        self.key = key
        self.keep_warm_s = keep_warm_s
        self.low_memory_fraction = low_memory_fraction  # (0: never stops for memory)
        self.engine: Any = None
        self._starting: asyncio.Future | None = None
        self._start_began = 0.0
        self.token: str | None = None
        self.lessee: Any = None
        self.run = ""  # the lessee's run (its processor call)
        self.chain: list[Stage] | None = None
        self._tasks: set[asyncio.Task] = set()
        self.idle_since = time.time()
        self.last_active = time.time()
        self.leases = 0
        self._closing = False
        self._watcher: asyncio.Task | None = None

    # -- leases ------------------------------------------------------------------------------

    async def lease(self, token: str, chain: list[Stage], lessee: Any, keep_warm_s: float,
                    run: str = "") -> dict[str, Any]:
        """Lease this host to a run's replica: ``chain`` (the run's stages, one of them its
        engine stage) runs here, the engine stage on this host's engine, started now if it is
        not yet. Returns ``{"ok": bool, ...}``; raises the engine's :class:`EngineStartError`
        where it cannot start. A live lessee of the same ``run`` keeps the host however long it
        idles: it is a peer replica waiting for the others before its first batch, not the last
        run's replica on its way out (taking its host put the run's replicas on one engine)."""
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        if self._closing:
            return {"ok": False, "why": "stopping"}
        if self.token not in (None, token) and run and run == self.run and await self._lessee_alive():
            return {"ok": False, "why": "leased"}
        if self.token not in (None, token):
            deadline = time.monotonic() + HANDOVER_WAIT_S
            while self.token is not None:
                if self._idle_lessee() or not await self._lessee_alive():
                    self._release()
                    break
                if time.monotonic() > deadline:
                    return {"ok": False, "why": "leased"}
                await asyncio.sleep(0.2)
        self.token, self.lessee, self.keep_warm_s, self.run = token, lessee, keep_warm_s, run
        leased_at = time.time()
        warm = self.engine is not None
        stage = next(s for s in chain if isinstance(s, EngineStage))
        for position, other in enumerate(chain):
            other.position = position
        if self._starting is None:
            self._start_began = leased_at
            self._starting = asyncio.ensure_future(self._start(stage.engine))
        try:
            # the other stages load what they need (tokenizers: once per host) beside the engine
            others = [s for s in chain if s is not stage]
            await asyncio.gather(asyncio.shield(self._starting), asyncio.to_thread(_start_stages, others))
        except BaseException:
            if self.token == token:
                self._release()
            raise
        if self.token != token:  # given away while the engine started (this lessee looked dead)
            return {"ok": False, "why": "leased"}
        stage.adopt(self.engine, start_at=leased_at if warm else self._start_began)
        self.chain = chain
        self.last_active = time.time()
        self.leases += 1
        return {"ok": True, "warm": warm, "leases": self.leases, "where": f"{os.uname().nodename}:{os.getpid()}"}

    async def _start(self, engine: Any) -> None:
        try:
            await engine.start()
        except BaseException:
            self._closing = True  # a host whose engine cannot start is no use to the next run
            asyncio.get_running_loop().call_later(1.0, self._exit)
            raise
        self.engine = engine

    async def release(self, token: str) -> None:
        """The run is over: the engine stays loaded for ``keep_warm_s`` idle seconds."""
        if self.token == token:
            self._release()

    def _release(self) -> None:
        self.token, self.lessee, self.chain, self.run = None, None, None, ""
        for task in list(self._tasks):
            task.cancel()
        self.idle_since = time.time()

    def _idle_lessee(self) -> bool:
        """The lessee has no batch here and sent none for :data:`TAKEOVER_IDLE_S` (an engine
        that is still starting for it is busy)."""
        starting = self._starting is not None and not self._starting.done()
        return not starting and not self._tasks and time.time() - self.last_active > TAKEOVER_IDLE_S

    async def _lessee_alive(self) -> bool:
        """Whether the lessee (a replica actor) lives; one that does not answer in time, busy
        with a batch, counts as alive."""
        if self.lessee is None:
            return True
        from ray.exceptions import RayActorError

        try:
            await asyncio.wait_for(asyncio.wrap_future(self.lessee.__ray_ready__.remote().future()), 5.0)
        except RayActorError:
            return False
        except Exception:  # noqa: BLE001 - a timeout or a transient error: alive
            return True
        return True

    # -- rows --------------------------------------------------------------------------------

    async def run(self, token: str, rows: list[Row]) -> AsyncIterator[list[Row]]:
        """The lease's stages over ``rows``, streamed back as rows finish."""
        if token != self.token or self.chain is None:
            raise LeaseLost("this engine host was handed to another run")
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            async for chunk in run_stages(self.chain, rows):
                yield chunk
        finally:
            if task is not None:
                self._tasks.discard(task)
            self.idle_since = self.last_active = time.time()

    # -- lifetime ----------------------------------------------------------------------------

    def state(self, memory: bool = False) -> dict[str, Any]:
        """What a lease that makes room looks at; ``memory``: with the bytes stopping this host
        would give back (``memory_bytes``) and its node."""
        out = {"key": self.key, "leased": self.token is not None, "idle_s": time.time() - self.idle_since,
               "engine": self.engine is not None, "stopping": self._closing, "leases": self.leases}
        if memory:
            import ray

            out.update(memory_bytes=tree_memory(), node=ray.get_runtime_context().get_node_id())
        return out

    async def stop(self) -> bool:
        """Stop the engine and this host, unless it is leased; returns whether it stops."""
        if self.token is not None and await self._lessee_alive():
            return False
        await self._close("made room for another host")
        return True

    async def _close(self, why: str) -> None:
        if self._closing and self.engine is None:
            return
        # the start ledger (LLMBATCH_START_LOG) says why a warm engine went: the next start of
        # these settings is what it costs
        startlog.record("warm-host-stop", time.time(), 0.0, why=why, key=self.key, leases=self.leases,
                        idle_s=round(time.time() - self.idle_since, 1), engine=self.engine is not None)
        self._closing = True
        self._release()
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                await engine.close()
            except Exception:  # noqa: BLE001 - the host goes away either way
                logger.debug("warm engine close failed", exc_info=True)
        asyncio.get_running_loop().call_later(0.1, self._exit)

    def _exit(self) -> None:
        import ray

        try:
            ray.get_runtime_context().current_actor.__ray_terminate__.remote()
        except Exception:  # noqa: BLE001 - nothing else to do; Ray ends it with the cluster
            logger.debug("warm engine host could not end itself", exc_info=True)

    async def _watch(self) -> None:
        checked = time.monotonic()
        short_since: float | None = None  # since when the machine is short of memory, idle here
        while not self._closing:
            await asyncio.sleep(WATCH_EVERY_S)
            if self.token is not None:
                short_since = None
                # a lessee that died without giving the host back (a killed driver): look now
                # and then, a batch of its running here or not (the batch of a dead lessee is
                # cancelled: its requests leave the engine, no one would read its answers)
                if time.monotonic() - checked > 5 * WATCH_EVERY_S:
                    checked = time.monotonic()
                    if not await self._lessee_alive():
                        self._release()
                continue
            if self._starting is not None and not self._starting.done():
                continue
            if time.time() - self.idle_since > self.keep_warm_s:
                await self._close("idle for keep_warm_s")
            elif short_of_memory(self.low_memory_fraction):
                short_since = short_since or time.monotonic()
                if stops_for_memory(time.monotonic() - short_since, self.leases):
                    logger.info("warm engine host stops: its machine is short of memory")
                    await self._close("its machine short of memory")
            else:
                short_since = None


def _start_stages(stages: list[Stage]) -> None:
    """Start the chain's CPU stages one by one (on a thread of the host's)."""
    for stage in stages:
        stage.begin()
        asyncio.run(stage.start())
