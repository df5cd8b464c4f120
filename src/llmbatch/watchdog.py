"""Never wait in silence: the stall detector of a processor's Ray Data run.

A run can stop moving for reasons no single operator sees: a task that needs a whole CPU on
a cluster whose CPUs are all held by actors, an engine replica that can never be placed, a
shuffle waiting for a CPU that a blocked read task holds. Ray Data then waits forever.

Two parts watch for it:

- every worker of a processor (:class:`~llmbatch.stages.runner.StageRunner`) publishes a
  :class:`Heartbeat` in Ray's internal key-value store every few seconds: whether it is still
  starting (an engine loading its model) or waiting for its peers (:func:`wait_for_peers`),
  and how many requests are inside its engine;
- :class:`StallWatchdog`, a Ray Data execution callback in the driver, looks at every
  scheduling step whether any operator made progress (outputs taken, tasks finished, blocks
  moved) or any worker is starting or working. When nothing happened for
  ``stall_timeout_s``, it fails the run with a :class:`~llmbatch.errors.StallError` that names
  the operator that waits, the resource it waits for, what holds that resource, and the fix.

A consumer that is slow to take the output (a user's loop over ``iter_batches``) is not a
stall: the run waits for it, as it should.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from llmbatch.errors import StallError

logger = logging.getLogger(__name__)

NAMESPACE = "llmbatch"
CONFIG_KEY = "llmbatch.watchdog"
#: How often a worker publishes its heartbeat.
HEARTBEAT_EVERY_S = 5.0
#: A heartbeat older than this says nothing (its worker died or hangs).
HEARTBEAT_FRESH_S = 4 * HEARTBEAT_EVERY_S
#: How often the watchdog reads the heartbeats (each read is one call to Ray's GCS).
READ_EVERY_S = 2.0


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def _prefix(run_id: str) -> bytes:
    return f"hb/{run_id}/".encode()


class Heartbeat:
    """A worker's heartbeat: a thread that publishes ``probe()`` every few seconds.

    ``probe`` returns ``{"state": "starting" | "ready", "in_flight": int, "done": int}``; the
    heartbeat adds the time, host and process. Publishing never fails the worker.
    """

    def __init__(self, run_id: str, role: str, probe: Callable[[], dict[str, Any]],
                 every_s: float = HEARTBEAT_EVERY_S):
        self.key = _prefix(run_id) + uuid.uuid4().hex.encode()
        self.role = role
        self.probe = probe
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llmbatch-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        try:
            value = {**self.probe(), "role": self.role, "at": time.time(),
                     "where": f"{os.uname().nodename}:{os.getpid()}"}
            _kv()._internal_kv_put(self.key, json.dumps(value).encode(), overwrite=True, namespace=NAMESPACE)
        except Exception:  # noqa: BLE001 - a heartbeat must never break the worker
            logger.debug("heartbeat failed", exc_info=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        try:
            _kv()._internal_kv_del(self.key, namespace=NAMESPACE)
        except Exception:  # noqa: BLE001 - the run is over either way
            pass


def read_heartbeats(run_id: str) -> list[dict[str, Any]]:
    """Every heartbeat published for ``run_id`` (stale ones included; see ``at``)."""
    kv = _kv()
    out = []
    for key in kv._internal_kv_list(_prefix(run_id), namespace=NAMESPACE) or []:
        raw = kv._internal_kv_get(key, namespace=NAMESPACE)
        if raw:
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
    return out


def is_fresh(beat: dict[str, Any]) -> bool:
    """Whether a heartbeat still says something (its worker published it lately)."""
    return time.time() - float(beat.get("at", 0)) < HEARTBEAT_FRESH_S


def wait_for_peers(run_id: str, role: str, peers: int, timeout_s: float, poll_s: float = 1.0) -> int:
    """Block until ``peers`` workers of ``role`` (this one included) have started, so that all
    replicas share the work from the first batch on instead of the first one queueing it all;
    returns how many did. Bounded: after ``timeout_s`` the ones that started go ahead (and a
    replica that can never be placed does not hold the run)."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    count = 0
    while True:
        try:
            beats = read_heartbeats(run_id)
        except Exception:  # noqa: BLE001 - cannot see the peers: do not wait for them
            return 1
        started = [b for b in beats if b.get("role") == role and b.get("state") in ("waiting", "ready")
                   and is_fresh(b)]
        count = len(started)
        if count >= peers:
            # every replica computes the same moment from the same heartbeats and goes then,
            # so Ray Data sees them ready together and hands each its share
            release = max(float(b.get("waiting_since") or 0) for b in started) + 2 * poll_s
            time.sleep(max(0.0, min(release - time.time(), 2 * poll_s)))
            return count
        if time.monotonic() >= deadline:
            logger.warning("%d of %d replicas of %s started within %.0f s; the others are left to catch up",
                           count, peers, role, timeout_s)
            return count
        time.sleep(poll_s)


def wait_for_engines(run_id: str, role: str, engines: str, timeout_s: float, poll_s: float = 1.0) -> bool:
    """A worker that a pool of ``role`` adds once one of its workers works: wait, before it
    loads anything, while a replica of ``engines`` (the engine operator) is still starting;
    returns whether it waited (heartbeats change every few seconds: one read a second).

    An engine's start is CPU-bound where it compiles and captures CUDA graphs, and no row
    reaches it before it is ready: the pool's first worker prepares the rows it will take
    first, and the workers Ray Data adds meanwhile (each loads the tokenizer, ~14 CPU-s on a
    16-core H200 node) only took the engine's CPU (its start 4.3 s slower, issue 29). A pool's
    first worker, and any worker once no engine is starting, starts at once. Bounded by
    ``timeout_s`` (an engine that never says ready does not hold the pool back)."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while time.monotonic() < deadline:
        try:
            beats = [b for b in read_heartbeats(run_id) if is_fresh(b)]
        except Exception:  # noqa: BLE001 - cannot see the engines: do not wait for them
            break
        working = any(b.get("role") == role and b.get("state") == "ready" for b in beats)
        starting = any(b.get("role") == engines and b.get("state") == "starting" for b in beats)
        if not (working and starting):
            break
        waited = True
        time.sleep(poll_s)
    return waited


def clear_heartbeats(run_id: str) -> None:
    try:
        _kv()._internal_kv_del(_prefix(run_id), del_by_prefix=True, namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - best effort
        pass


def watch(context, run_id: str, timeout_s: float | None) -> None:
    """Install the watchdog on a dataset's ``DataContext`` (``timeout_s`` None or <= 0: off)."""
    if not timeout_s or timeout_s <= 0:
        return
    context.set_config(CONFIG_KEY, {"run_id": run_id, "timeout_s": float(timeout_s)})
    classes = list(context.custom_execution_callback_classes or [])
    if StallWatchdog not in classes:
        classes.append(StallWatchdog)
    context.custom_execution_callback_classes = classes


# ---------------------------------------------------------------------------- the watchdog


def _execution_callback_base():
    from ray.data._internal.execution.execution_callback import ExecutionCallback

    return ExecutionCallback


class StallWatchdog(_execution_callback_base()):
    """Fails a run that made no progress for ``stall_timeout_s`` (see module docstring)."""

    def __init__(self):
        self.run_id: str | None = None
        self.timeout_s = 0.0
        self.clock = time.monotonic
        self._last_state: Any = None
        self._last_progress = 0.0
        self._last_read = 0.0
        self._beats: list[dict[str, Any]] = []

    def before_execution_starts(self, executor) -> None:
        config = executor._data_context.get_config(CONFIG_KEY)
        if not config:
            return
        self.run_id = config["run_id"]
        self.timeout_s = float(config["timeout_s"])
        self._last_progress = self.clock()

    def on_execution_step(self, executor) -> None:
        if self.run_id is None:
            return
        now = self.clock()
        state = _progress_state(executor)
        if state != self._last_state:
            self._last_state = state
            self._last_progress = now
        if now - self._last_read >= READ_EVERY_S:
            self._last_read = now
            try:
                self._beats = read_heartbeats(self.run_id)
            except Exception:  # noqa: BLE001 - no heartbeats: judge by the operators alone
                self._beats = []
            if any(_busy(b) for b in self._beats) or _consumer_is_behind(executor):
                self._last_progress = now
        if now - self._last_progress >= self.timeout_s:
            raise StallError(diagnose(executor, now - self._last_progress, self.timeout_s, self._beats))

    def after_execution_succeeds(self, executor) -> None:
        if self.run_id:
            clear_heartbeats(self.run_id)

    def after_execution_fails(self, executor, error: Exception) -> None:
        if self.run_id:
            clear_heartbeats(self.run_id)


def _busy(beat: dict[str, Any]) -> bool:
    """A fresh heartbeat of a worker that is starting or has requests in its engine."""
    return is_fresh(beat) and (beat.get("state") in ("starting", "waiting") or int(beat.get("in_flight") or 0) > 0)


def _progress_state(executor) -> tuple:
    """Everything that changes when an operator makes progress."""
    out = []
    for op, state in executor._topology.items():
        m = op.metrics
        out.append((getattr(m, "num_outputs_taken", 0), getattr(m, "num_tasks_finished", 0),
                    state.total_enqueued_input_blocks(), state.total_enqueued_output_blocks(),
                    op.num_active_tasks()))
    return tuple(out)


def _consumer_is_behind(executor) -> bool:
    """Output is ready and waits for the caller to take it: the caller is slow, not us."""
    try:
        _, state = executor._output_node
        return len(state.output_queue) > 0
    except Exception:  # noqa: BLE001 - unknown: do not excuse the stall
        return False


# ---------------------------------------------------------------------------- diagnosis


def _fmt(res: Any) -> str:
    parts = []
    for name, label in (("cpu", "CPU"), ("gpu", "GPU")):
        value = getattr(res, name, 0) or 0
        if value:
            parts.append(f"{value:g} {label}")
    return ", ".join(parts) or "nothing"


def _op_facts(executor, op) -> dict[str, Any]:
    state = executor._topology[op]
    facts: dict[str, Any] = {"name": op.name, "active": op.num_active_tasks(),
                             "queued": state.total_enqueued_input_blocks(), "holds": None, "needs": None,
                             "pending_actors": 0, "actors": 0}
    try:
        facts["holds"] = executor._resource_manager.get_op_usage(op)
    except Exception:  # noqa: BLE001
        pass
    try:
        facts["needs"] = op.incremental_resource_usage()
    except Exception:  # noqa: BLE001
        pass
    pool = getattr(op, "_actor_pool", None)
    if pool is not None:
        try:
            facts["pending_actors"] = pool.num_pending_actors()
            facts["actors"] = pool.num_running_actors()
        except Exception:  # noqa: BLE001
            pass
    return facts


def diagnose(executor, stalled_s: float, timeout_s: float, beats: list[dict[str, Any]]) -> str:
    """What waits, for what, what holds it, and what to do (the text of a StallError)."""
    import ray

    try:
        total = ray.cluster_resources()
        free = ray.available_resources()
    except Exception:  # noqa: BLE001
        total, free = {}, {}
    facts = [_op_facts(executor, op) for op, _ in executor._topology.items()
             if not op.has_completed() and op.name != "Input"]
    waiting = [f for f in facts if f["queued"] or f["pending_actors"]
               or (f["active"] and f["needs"] is not None and getattr(f["needs"], "cpu", 0) > free.get("CPU", 0))]
    holding = [f for f in facts if f["holds"] is not None and (getattr(f["holds"], "cpu", 0) or getattr(f["holds"], "gpu", 0))]
    lines = [f"the pipeline made no progress for {stalled_s:.0f} s (stall_timeout_s={timeout_s:g}) and no engine "
             "replica is starting or working."]
    for f in waiting:
        what = []
        if f["pending_actors"]:
            what.append(f"{f['pending_actors']} worker(s) that cannot be placed")
        if f["queued"]:
            what.append(f"{f['queued']} input block(s) queued")
        if f["active"]:
            what.append(f"{f['active']} task(s) submitted")
        need = _fmt(f["needs"]) if f["needs"] is not None else "resources"
        lines.append(f"waiting: {f['name']} ({', '.join(what)}); each new task or worker needs {need}.")
    lines.append("cluster: " + ", ".join(f"{free.get(k, 0):g} of {total.get(k, 0):g} {k} free"
                                         for k in ("CPU", "GPU") if total.get(k)))
    for f in holding:
        who = f"{f['actors']} worker(s)" if f["actors"] else f"{f['active']} task(s)"
        lines.append(f"holding: {f['name']} holds {_fmt(f['holds'])} ({who}).")
    for op in executor._topology:
        if "CheckpointFilter" in op.name and not op.has_completed():
            cpus = (getattr(op, "_ray_remote_args", None) or {}).get("num_cpus", 1)
            lines.append(f"checkpoints: Ray Data's CheckpointFilter is an actor pool of {cpus:g} CPU per actor for "
                         f"the whole run, and the read tasks in front of it need a CPU of their own "
                         f"({total.get('CPU', 0):g} CPU in the cluster).")
    stale = [b for b in beats if not _busy(b)]
    if stale:
        lines.append(f"workers: {len(beats)} llmbatch worker(s) report, none busy.")
    lines.append(
        "fix: give Ray more CPUs (ray.init(num_cpus=N) or a bigger cluster), or lower what the holders reserve: "
        "a stage config's num_cpus/concurrency, an ActorPoolStrategy size or num_cpus of your own map_batches, "
        "or the CPUs of a Ray Data checkpoint filter. If the run is only slow, raise stall_timeout_s "
        "(0 turns the check off).")
    return "\n  ".join(lines)
