"""Running a chain of stages as one Ray Data operator.

:class:`StageRunner` is the callable class handed to ``Dataset.map_batches``. It holds an
asyncio loop on a thread of its own (the engine's home), runs its stages in order over each
batch, and yields rows as soon as the stages let go of them, so Ray Data moves them on while
the rest of the batch is still in the engine.

Between operators a row travels encoded (:mod:`llmbatch.codec`); the first operator reads the
user's columns, the last one turns rows into typed Arrow columns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pyarrow as pa

from llmbatch.codec import decode_rows, empty_engine_output, encode_rows, rows_to_table
from llmbatch.errors import RowError
from llmbatch.rows import (
    ERROR_COLUMN,
    PRIVATE_PREFIX,
    Row,
    describe_row,
    is_error,
    parse_error,
)
from llmbatch.stages.base import Stage
from llmbatch.stages.user_fns import PostprocessStage, default_output
from llmbatch.watchdog import Heartbeat, wait_for_peers

logger = logging.getLogger(__name__)
#: How long closing one stage may take when the runner goes away (an engine's shutdown).
CLOSE_TIMEOUT_S = 30.0


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

    ``sink``: this is the last operator; rows leave as the user's output rows: typed columns,
    or, with ``encoded_output``, still encoded (the job driver types them when it commits).
    ``continue_on_error``: error rows travel on as rows; off, the first one fails the run.
    ``keep_private``: private keys to keep in the sink's output (the job layer's row ids).
    ``batch_rows``: rows per call of each stage; a block of more rows runs as batches of this
    many side by side (:func:`run_batches`), 0: the block is one batch.
    """

    def __init__(self, stages: list[Stage], *, sink: bool = False, encoded_output: bool = False,
                 task_type: str = "generate", continue_on_error: bool = True,
                 keep_private: tuple[str, ...] = (), run_id: str | None = None, role: str = "",
                 peers: int = 1, peer_wait_s: float = 300.0, batch_rows: int = 0):
        self.stages = stages
        self.batch_rows = batch_rows
        # the user's postprocess shapes the output rows (also where a warm host runs it: the
        # chain of llmbatch.stages.warm)
        self._postprocess = any(isinstance(inner, PostprocessStage) for s in stages
                                for inner in getattr(s, "chain", [s]))
        for position, stage in enumerate(stages):
            stage.position = position
        self.sink = sink
        self.encoded_output = encoded_output
        self._json_columns: set[str] = set()
        self.task_type = task_type
        self.continue_on_error = continue_on_error
        self.keep_private = keep_private
        self._state = "starting"
        self._waiting_since = 0.0
        self._heartbeat = None
        if run_id is not None:
            self._heartbeat = Heartbeat(run_id, role, self._probe).start()
        self._loop = _LoopThread()
        self._start_stages()
        if run_id is not None and peers > 1:
            self._state = "waiting"
            self._waiting_since = time.time()
            self._heartbeat.beat()
            wait_for_peers(run_id, role, peers, peer_wait_s)
        self._state = "ready"
        if self._heartbeat is not None:
            self._heartbeat.beat()

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

    def _output_row(self, row: Row) -> dict[str, Any]:
        private = {k: row[k] for k in self.keep_private if k in row}
        if is_error(row):
            out = default_output(row)
            for key, value in empty_engine_output(self.task_type, row).items():
                out.setdefault(key, value)
            out.update(private)
            return out
        if self._postprocess:
            out = {k: v for k, v in row.items() if not k.startswith(PRIVATE_PREFIX)}
            # a job's driver (encoded output) reads every row's error column: the row's state
            if not self.continue_on_error and not self.encoded_output:
                out.pop(ERROR_COLUMN, None)
        else:
            out = default_output(row)
            out.setdefault(ERROR_COLUMN, "")
        out.update(private)
        return out

    def _stop_at_errors(self, chunk: list[Row]) -> None:
        """Without continue_on_error, the first error row fails the run, naming the row."""
        failed = next((r for r in chunk if is_error(r)), None)
        if failed is not None:
            stage, error_type, message = parse_error(failed[ERROR_COLUMN])
            raise RowError(stage, error_type, message, describe_row(failed))

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        rows = decode_rows(batch)
        for chunk in self._loop.iterate(run_batches(self.stages, rows, self.batch_rows)):
            if not chunk:
                continue
            if not self.continue_on_error:
                self._stop_at_errors(chunk)
            if self.sink and self.encoded_output:
                yield encode_rows([self._output_row(r) for r in chunk])
            elif self.sink:
                yield rows_to_table([self._output_row(r) for r in chunk], self._json_columns)
            else:
                yield encode_rows(chunk)

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
