"""The stage contract: one async method over a batch of rows.

A stage declares the keys it needs (:attr:`Stage.required_keys`), loads heavy state lazily in
the worker (:meth:`Stage.setup`), and turns rows into rows. ``await``-ing is optional: most
stages are synchronous per-row functions (:meth:`Stage.process_row`); the engine stage
overrides :meth:`Stage.__call__` to stream rows out as they finish. The synchronous work runs
on one thread per process beside the runner's loop (:class:`CpuThread`), never on the loop: the
loop is the engine's home (vLLM's AsyncLLM and SGLang's tokenizer manager take requests and hand
out outputs there), and a batch's decode, parse, template or tokenization on it would hold every
request back. Beside a busy thread, though, the loop waits for the GIL each time it wakes from
I/O, up to Python's switch interval (5 ms by default), so a process with the CPU thread switches
every :data:`SWITCH_INTERVAL_S` instead (``python bench/loop_gil.py``: a loop's socket round
trips beside a thread doing Python work: 60-76/s at 5 ms, 1,041-1,059/s at 0.2 ms, alone 10,000/s)
where it has :data:`SWITCH_MIN_CORES` cores or more. On fewer, the engine's own processes and
the replica's threads share the cores, the OS preempts the busy thread anyway (3,959 round
trips/s at 5 ms with both of 2 cores busy) and a forced switch often waits for a thread that is
not on a core (its work fell by 31% at 0.2 ms there): Python's default stays.

Errors are per row. A row whose processing raises becomes an error row (its
``__inference_error__`` says ``"<stage>: <ErrorType>: <message>"``) and skips every later
stage. Stages only mark rows; when the processor does not continue on error, the runner
fails the run at the first error row with a :class:`~llmbatch.errors.RowError` carrying the
same text and the row id.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import queue
import sys
import threading
from collections.abc import AsyncIterator
from typing import ClassVar

import pyarrow as pa

from llmbatch.codec import encode_rows
from llmbatch.rows import ERROR_COLUMN, Row, error_text, is_error


#: The GIL switch interval of a process with a CPU thread, given the cores (module docstring).
SWITCH_INTERVAL_S = 0.0002
SWITCH_MIN_CORES = 4


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class CpuThread:
    """The one thread on which a process's stages do their synchronous work (one thread:
    stages and users' functions see no concurrency they did not see on the loop). Later
    stages go first: a batch on its way to the engine passes the batches still waiting for
    their first stage, so the engine gets its first requests after one batch's work, not
    after every batch in flight has been through the first stage."""

    def __init__(self):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        if _usable_cores() >= SWITCH_MIN_CORES:
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        threading.Thread(target=self._work, name="llmbatch-cpu", daemon=True).start()

    def submit(self, position: int, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((-position, next(self._order), fn, args, future))
        return future

    def _work(self) -> None:
        while True:
            _, _, fn, args, future = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting stage
                future.set_exception(exc)


_CPU_THREAD: CpuThread | None = None
_CPU_LOCK = threading.Lock()


def cpu_thread() -> CpuThread:
    """This process's :class:`CpuThread`, started on first use."""
    global _CPU_THREAD
    with _CPU_LOCK:
        if _CPU_THREAD is None:
            _CPU_THREAD = CpuThread()
        return _CPU_THREAD


class Stage:
    """Base class of all stages. Subclasses set :attr:`name` and implement one of
    :meth:`process_row`, :meth:`process_batch` or :meth:`__call__`."""

    #: The stage's name, as it appears in error texts ("tokenize", "engine", ...).
    name: ClassVar[str] = "stage"
    #: Whether :meth:`start` starts an engine (it then runs on the runner's loop, beside the
    #: other stages' starts, which run on a thread of their own: :class:`StageRunner`).
    starts_engine: ClassVar[bool] = False
    #: Keys every (non-error) input row must have; missing keys fail the row.
    required_keys: ClassVar[tuple[str, ...]] = ()
    #: Alternative key sets: a row must have at least one key of each tuple.
    required_any: ClassVar[tuple[tuple[str, ...], ...]] = ()
    #: The stage's place in its runner's chain (the runner sets it): later stages' work goes
    #: first on the CPU thread.
    position: int = 0

    def __init__(self):
        self._ready = False

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """Runs in the driver each time the processor runs, before the stage is shipped to its
        workers: create what the workers share (an endpoint's cluster-wide rate schedule)."""

    def setup(self) -> None:
        """Load heavy state (tokenizers). Runs once, in the worker, before first use."""

    def begin(self) -> None:
        """Runs first when a replica with an engine starts, on its own thread, before any
        stage's :meth:`start` (engines' first): launch helper processes (an engine's fork
        server) and import what the starts share, so that the starts can then run side by
        side. A replica without an engine (CPU workers) does not call it."""

    async def start(self) -> None:
        """Acquire state that must exist before the first batch: by default :meth:`setup`
        (tokenizers load while the replica's engine starts, not after it, before the first
        batch). The engine overrides this to start the model server, so that a model that
        cannot load fails the replica at once."""
        self.ensure_setup()

    def ensure_setup(self) -> None:
        if not self._ready:
            self.setup()
            self._ready = True

    async def close(self) -> None:
        """Release what :meth:`setup` acquired."""

    # -- errors ------------------------------------------------------------------------------

    def fail(self, row: Row, exc: BaseException, stage: str | None = None) -> Row:
        """Mark ``row`` as failed in this stage (or the named step of it); returns it."""
        row[ERROR_COLUMN] = error_text(stage or self.name, exc)
        return row

    def missing_keys(self, row: Row) -> list[str]:
        missing = [k for k in self.required_keys if k not in row or row[k] is None]
        for group in self.required_any:
            if not any(row.get(k) is not None for k in group):
                missing.append(" or ".join(group))
        return missing

    def check_keys(self, row: Row) -> bool:
        """True when ``row`` has what this stage needs; otherwise marks it failed."""
        missing = self.missing_keys(row)
        if not missing:
            return True
        present = sorted(k for k in row if not k.startswith("__"))
        self.fail(row, KeyError(
            f"stage '{self.name}' needs {', '.join(repr(m) for m in missing)} in the row, which has "
            f"{present}; return them from preprocess"
        ))
        return False

    # -- processing --------------------------------------------------------------------------

    def process_row(self, row: Row) -> None:
        """Update ``row`` in place. Raise to fail the row."""
        raise NotImplementedError

    def process_batch(self, rows: list[Row]) -> None:
        """Update ``rows`` in place; the default calls :meth:`process_row` on each row and
        turns its exceptions into error rows."""
        for row in rows:
            try:
                self.process_row(row)
            except Exception as exc:  # noqa: BLE001 - any failure of one row is that row's error
                self.fail(row, exc)

    async def __call__(self, rows: list[Row]) -> AsyncIterator[list[Row]]:
        """Process a batch on the CPU thread; yield finished rows (error rows pass straight
        through)."""
        await asyncio.wrap_future(cpu_thread().submit(self.position, self._process, rows))
        yield rows

    def to_table(self, rows: list[Row]) -> pa.Table:
        """The operator's output when this stage is its last: rows encoded for the next operator
        (:class:`~llmbatch.stages.output.OutputStage` shapes the processor's output instead)."""
        return encode_rows(rows)

    def _process(self, rows: list[Row]) -> None:
        self.ensure_setup()
        todo = [r for r in rows if not is_error(r) and self.check_keys(r)]
        if todo:
            self.process_batch(todo)
