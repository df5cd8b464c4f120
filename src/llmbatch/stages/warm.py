"""Warm engines: an engine that outlives its run, for the next run with the same settings.

A vLLM engine takes a minute to start on a laptop and tens of seconds on a GPU (imports, the
engine process, the weights, the KV cache). A notebook that runs a processor again, a
standing cluster that runs job after job, a test suite: each run paid it again. With
``keep_warm_s`` (a field of :class:`~llmbatch.config.vLLMEngineProcessorConfig`, default
``LLMBATCH_KEEP_WARM_S``) the engine lives in an *engine host*: a detached Ray actor named
after the engine's settings (``Engine.warm_key``: vLLM's with the defaults llmbatch gives it
where it runs filled in, so a run that asks for a default shares the engine of one that does
not). A run's replica leases a host, sends it the rows of its engine
stage and gives it back when the run ends; the host keeps its engine loaded for ``keep_warm_s``
idle seconds, and the next run with the same settings on the same Ray cluster leases it
instead of starting an engine.

- The host runs the replica's whole chain of fused stages (preprocess, chat template,
  tokenize, the engine stage, detokenize, postprocess): the run's own stage objects, shipped
  with each lease (its functions, settings and dedup cache), the engine stage adopting the
  host's engine. The tokenizers they load stay loaded in the host too; the replica only reads
  its input and shapes its output.
- One lease at a time per host. A host whose lessee died (a killed driver, a replica Ray took
  away) or has sent it no batch for :data:`TAKEOVER_IDLE_S` (the last run's replica, which Ray
  Data ends a moment after its last batch; never a live replica of the same run, which idles
  while it waits for its peers) is handed to the next run (a dead lessee's batch,
  still in the engine, is cancelled: the host looks at its lessee every ten seconds); a run that finds every
  matching host busy starts one more. A replica whose host was handed away while it idled
  leases another for its next batch.
- A host whose engine dies restarts it (the engine stage's own restart); a host that dies is
  replaced, and the rows it had not answered go to the new one.
- Before a new host starts, idle hosts of other settings stop, the least used first (the
  fewest leases served, then the longest idle): on a GPU all of them (a host holds its device);
  on a CPU all but :data:`IDLE_OTHERS_CPU`, and where the machine has less than
  :data:`ROOM_FRACTION` (``LLMBATCH_WARM_ROOM_FRACTION``) of its memory available, more of them, until the memory they hold
  makes up what is missing. The engine that most runs use stays loaded while one-off settings
  come and go. An idle host also stops by itself when its machine runs short of memory
  (:data:`~llmbatch.stages.engine_host.LOW_MEMORY_FRACTION`), the least used first: warm engines
  never take the memory a run needs.
- A host whose engine cannot start fails the lease with the reason and stops.

Only for engines of one device and no placement group (the engine's workers would outlive a
replica's placement group otherwise). The hosts die with the Ray cluster (``llmbatch run``
without ``RAY_ADDRESS`` starts and stops its own).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from llmbatch.env import env_number
from llmbatch.errors import EngineStartError
from llmbatch.rows import PRIVATE_PREFIX, STATS, Row
from llmbatch.stages.base import Stage
from llmbatch.stages.engine import EngineStage, process_start
from llmbatch.stages.engine_host import LOW_MEMORY_FRACTION, EngineHost, LeaseLost, memory_shortfall

logger = logging.getLogger(__name__)

#: Ray namespace and name prefix of the hosts (``llmbatch-warm:<settings digest>:<n>``).
NAMESPACE = "llmbatch-warm"
PREFIX = "llmbatch-warm"
#: The default of ``keep_warm_s`` (seconds), where the config leaves it unset.
KEEP_WARM_ENV = "LLMBATCH_KEEP_WARM_S"
#: Leases a replica takes before its run fails (a host that died mid-run, a lease lost).
LEASE_ATTEMPTS = 3
#: Idle hosts of other settings kept when a new host starts, on a cluster without GPUs (where
#: ``LLMBATCH_WARM_IDLE_OTHERS`` sets no other number: a machine with the memory for more engines,
#: a test suite that goes back to a setting after others).
IDLE_OTHERS_CPU = 3
IDLE_OTHERS_ENV = "LLMBATCH_WARM_IDLE_OTHERS"
#: Where less than this share of the machine's memory is available, a new host starts only after
#: idle hosts of other settings that hold what is missing have stopped (``LLMBATCH_WARM_ROOM_FRACTION``
#: sets another share: a machine that runs small engines side by side needs less room per start).
ROOM_FRACTION = 0.35
ROOM_ENV = "LLMBATCH_WARM_ROOM_FRACTION"
#: The row key that tells a replica which of its rows came back from the host.
_INDEX = f"{PRIVATE_PREFIX}warm_i"


def idle_others_cpu() -> int:
    """How many idle hosts of other settings a CPU cluster keeps: ``LLMBATCH_WARM_IDLE_OTHERS``,
    else :data:`IDLE_OTHERS_CPU` (memory still rules: below :data:`ROOM_FRACTION` fewer stay)."""
    return env_number(IDLE_OTHERS_ENV, IDLE_OTHERS_CPU, lambda raw: max(0, int(raw)), "a whole number", "3")


def _share(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value < 1.0:
        raise ValueError(raw)
    return value


def room_fraction() -> float:
    """The share of the machine's memory a new host wants available: ``LLMBATCH_WARM_ROOM_FRACTION``,
    else :data:`ROOM_FRACTION`."""
    return env_number(ROOM_ENV, ROOM_FRACTION, _share, "a share of memory between 0 and 1", "0.25")


def keep_warm_default() -> float:
    """``LLMBATCH_KEEP_WARM_S`` as seconds (0 where unset)."""
    return env_number(KEEP_WARM_ENV, 0.0, lambda raw: max(0.0, float(raw)), "a number of seconds", "600")


def _host_class():
    import ray

    return ray.remote(EngineHost)


def warm_key(stage: EngineStage, host_resources: dict[str, Any]) -> str:
    """A digest of what makes two engines interchangeable: the engine's own settings, where it
    runs, and llmbatch's version."""
    from llmbatch import __version__

    text = repr((stage.engine.warm_key(gpu=bool(host_resources.get("num_gpus"))), sorted((k, repr(v)) for k, v in host_resources.items()), __version__))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _hosts() -> dict[str, str]:
    """name -> settings digest of every host on the cluster."""
    import ray

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry.get("name", "")
        if entry.get("namespace") == NAMESPACE and name.startswith(PREFIX + ":"):
            out[name] = name.split(":")[1]
    return out


async def _stop_idle_others(key: str, keep: int, room: float = 0.0) -> None:
    """Stop idle hosts of other settings, the least used first (fewest leases, then the longest
    idle): all but the ``keep`` most used, then, where this machine has less than ``room`` of its
    memory available, more of them until the memory they hold here makes up the difference."""
    import ray

    missing = memory_shortfall(room) if room > 0 else 0  # the hosts' memory is read only then
    idle = []
    for name, other in _hosts().items():
        if other == key:
            continue
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            state = await handle.state.remote(memory=missing > 0)
        except Exception:  # noqa: BLE001 - gone since it was listed
            continue
        if not state["leased"] and not state["stopping"]:
            idle.append((state, name, handle))
    idle.sort(key=lambda item: (-item[0].get("leases", 0), item[0]["idle_s"]))  # the most used first
    stop, kept = idle[keep:], idle[:keep]
    if missing:
        here = ray.get_runtime_context().get_node_id()

        def frees(state: dict) -> int:
            return int(state.get("memory_bytes") or 0) if state.get("node") == here else 0

        missing -= sum(frees(state) for state, _, _ in stop)
        for item in reversed(kept):  # the least used of those the count rule keeps
            if missing <= 0:
                break
            if frees(item[0]):
                stop.append(item)
                missing -= frees(item[0])
    for state, name, handle in stop:
        try:
            await handle.stop.remote()
            logger.info("stopped idle warm engine host %s to make room (%d leases)", name, state.get("leases", 0))
        except Exception:  # noqa: BLE001 - gone already
            continue


async def lease(chain: list[Stage], key: str, keep_warm_s: float,
                host_resources: dict[str, Any], run: str = "") -> tuple[Any, str]:
    """Lease a host for ``chain`` (one with ``key`` that is free, else a new one) for a replica
    of ``run``; returns the host's handle and the lease's token."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        me = ray.get_runtime_context().current_actor
    except Exception:  # noqa: BLE001 - not in an actor (a driver): the host cannot look at it
        me = None
    token = uuid.uuid4().hex
    hosts = {name for name, other in _hosts().items() if other == key}
    tried: set[str] = set()
    for index in range(len(hosts) + 16):
        name = next((n for n in sorted(hosts) if n not in tried), None)
        if name is None:  # every host of these settings is busy: one more
            if host_resources.get("num_gpus"):
                await _stop_idle_others(key, 0)
            else:
                await _stop_idle_others(key, idle_others_cpu(), room=room_fraction())
            taken = set(_hosts())
            name = next(f"{PREFIX}:{key}:{n}" for n in range(len(taken) + 1) if f"{PREFIX}:{key}:{n}" not in taken)
            options = {"name": name, "namespace": NAMESPACE, "lifetime": "detached", "get_if_exists": True,
                       "num_cpus": 0, "max_restarts": 0, **host_resources}
            handle = _host_class().options(**options).remote(key, keep_warm_s, LOW_MEMORY_FRACTION)
        else:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # gone since it was listed
                tried.add(name)
                continue
        tried.add(name)
        try:
            answer = await handle.lease.remote(token, chain, me, keep_warm_s, run)
        except RayActorError:
            continue  # the host died (or is stopping): the next one
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            if isinstance(cause, EngineStartError):
                raise EngineStartError(str(cause)) from None
            raise
        if answer.get("ok"):
            logger.info("engine host %s leased (%s)", name, "warm" if answer.get("warm") else "started")
            return handle, token
    raise EngineStartError(f"no warm engine host could be leased for these settings ({key}); "
                           f"set keep_warm_s=0 to start an engine in each replica")


def _host_lost(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayActorError):
        return True
    return isinstance(exc, RayTaskError) and isinstance(exc.cause, LeaseLost)


class WarmEngineStage(Stage):
    """A replica's stages, run in a warm engine host (module docstring): in the replica, one
    stage that sends the rows of its batches to the host and streams back what the host's
    chain (:attr:`chain`) makes of them."""

    name = "engine"  # it stands for the engine stage in the layout (the host runs the real one)
    starts_engine = True

    def __init__(self, stage: EngineStage, keep_warm_s: float):
        super().__init__()
        self.local = stage
        #: the stages the host runs: the replica's fused chain with this engine stage in it
        #: (the processor sets it; alone, the engine stage)
        self.chain: list[Stage] = [stage]
        self.keep_warm_s = keep_warm_s
        #: what the host holds: the replica's devices (the processor sets them when it runs)
        self.host_resources: dict[str, Any] = {}
        self.key = ""
        #: the run's id (the processor sets it): a replica never takes a host from a peer of its run
        self.run = ""
        self.host: Any = None
        self.token = ""
        self.process_start_at = 0.0
        self.begin_at = 0.0
        #: requests inside the host's engine now, and answered so far (the replica's heartbeat)
        self.in_flight = 0
        self.done = 0

    def prepare(self) -> None:
        self.local.prepare()
        self.key = warm_key(self.local, self.host_resources)

    def seed(self, known_answers: Any, tag: str, journal: str = "") -> None:
        """The engine stage's (the host runs it): a job's answers from before, its journal."""
        self.local.seed(known_answers, tag, journal)

    def begin(self) -> None:
        self.process_start_at = process_start()
        self.begin_at = time.time()

    async def start(self) -> None:
        await self._lease()
        self._ready = True

    async def _lease(self) -> None:
        self.host, self.token = await lease(self.chain, self.key or warm_key(self.local, self.host_resources),
                                            self.keep_warm_s, self.host_resources, self.run)

    async def close(self) -> None:
        host, self.host = self.host, None
        if host is not None:
            try:
                await asyncio.wait_for(asyncio.wrap_future(host.release.remote(self.token).future()), 10.0)
            except Exception:  # noqa: BLE001 - the host sees this replica gone and frees itself
                logger.debug("warm engine host release failed", exc_info=True)

    def _stamp(self, row: Row) -> None:
        """The replica's own start in the row's engine facts (the host's process is older)."""
        stats = row.get(STATS)
        if isinstance(stats, dict):
            stats["process_start_at"] = self.process_start_at
            stats["begin_at"] = self.begin_at

    async def __call__(self, rows: list[Row]) -> AsyncIterator[list[Row]]:
        todo: dict[int, Row] = {}
        for i, row in enumerate(rows):
            row[_INDEX] = i
            todo[i] = row
        attempts = 0
        while todo:
            sent = len(todo)
            self.in_flight += sent
            try:
                stream = self.host.run.options(num_returns="streaming").remote(self.token, list(todo.values()))
                async for ref in stream:
                    chunk = await ref
                    for row in chunk:
                        todo.pop(row.pop(_INDEX, None), None)
                        self._stamp(row)
                    self.in_flight -= len(chunk)
                    sent -= len(chunk)
                    self.done += len(chunk)
                    yield chunk
            except Exception as exc:  # noqa: BLE001 - the host died or was handed away: another lease
                if not _host_lost(exc) or attempts >= LEASE_ATTEMPTS:
                    raise
                attempts += 1
                logger.warning("warm engine host lost (%s: %s); %d rows go to another", type(exc).__name__, exc,
                               len(todo))
                await self._lease()
            finally:
                self.in_flight -= sent
