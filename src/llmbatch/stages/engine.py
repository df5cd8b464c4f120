"""The engine stage: many requests in flight, rows streamed out as they finish.

Per replica, the stage keeps up to ``max_pending_requests`` requests inside the engine across
all the batches it is working on, so a batch's slow tail never starves the engine. Finished
rows leave in small chunks (``flush_rows`` rows or ``flush_seconds``), so one long generation
does not hold back the rows of its batch that finished before it.

Workload-level savings the engine cannot make alone:

- identical deterministic requests (same prompt, same sampling params, greedy or seeded) are
  sent once; the answer is copied to every such row (``dedup``);
- a batch is submitted in prompt order, so rows sharing a prompt prefix run together and hit
  the engine's prefix cache (``sort_by_prefix``).

A dead engine is restarted and its in-flight rows are retried up to ``max_attempts`` times;
rows that still fail become error rows.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from llmbatch.engines.base import Engine, Request
from llmbatch.errors import EngineDiedError, EngineStartError, StructuredOutputError
from llmbatch.rows import ANSWER, ERROR_COLUMN, STATS, Row, is_error
from llmbatch.stages.answers import AppendFile, Journal, answer_record, load_known
from llmbatch.stages.base import Stage, process_start
from llmbatch.stages.check_output import check_structured
from llmbatch.stages.turns import Turns

logger = logging.getLogger(__name__)

#: Bytes of recent deterministic answers a replica keeps for dedup across batches (keys are
#: 16-byte digests of the request, so long prompts cost nothing here).
RESULT_CACHE_BYTES = 64 << 20

#: A folder where each replica appends one byte per request it hands its engine, before it hands
#: it (retries included), so the count survives a SIGKILL: the benchmarks' exact count of the
#: requests that reached the engines across a kill and a resume (bench/industry_gpu.py). Read
#: in the driver's environment (replicas and warm engine hosts have their own).
REQUEST_TALLY_ENV = "LLMBATCH_REQUEST_TALLY_DIR"


class EngineStage(Stage):
    """Runs rows through an engine (see module docstring)."""

    name = "engine"
    starts_engine = True

    def __init__(self, engine: Engine, *, max_pending_requests: int | None = None, dedup_requests: bool = True,
                 sort_by_prefix: bool = True, max_attempts: int = 3, flush_rows: int = 16,
                 flush_seconds: float = 0.5, structured_output_errors: str = "error",
                 lora_base_rows_apart: bool | None = None):
        super().__init__()
        self.structured_output_errors = structured_output_errors
        #: base-model rows and adapter rows take turns in the engine (stages/turns.py); None:
        #: where the engine says it computes mixed steps wrongly
        self.lora_base_rows_apart = lora_base_rows_apart
        self.engine = engine
        # what a row must carry is the engine's to say (a prompt for vLLM; a payload, messages
        # or a prompt for an endpoint)
        self.required_any = engine.required_any
        self.max_pending_requests = max_pending_requests
        self.dedup_requests = dedup_requests
        self.sort_by_prefix = sort_by_prefix
        self.max_attempts = max_attempts
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.replica = ""
        self.devices = ""
        self.process_start_at = 0.0  # the replica's process started (the OS's record)
        self.begin_at = 0.0  # the replica's stages unpickled, its start begins
        self.start_at = 0.0  # when this replica began to start its engine
        self.ready_at = 0.0
        self.first_request_at = 0.0  # when this replica handed its engine its first request
        self._semaphore: asyncio.Semaphore | None = None
        self._turns: Turns | None = None
        self._inflight: dict[Any, asyncio.Future] = {}
        self._results: collections.OrderedDict[Any, tuple[dict[str, Any], int]] = collections.OrderedDict()
        self._results_bytes = 0
        self.result_cache_bytes = RESULT_CACHE_BYTES
        #: a job's answers from before (stages/answers.py): a dict or a Ray object of one, set
        #: by the job's driver with the tag its rows' answer records carry ("": none recorded)
        self.known_answers: Any = None
        self.answer_tag = ""
        self._known: dict[Any, dict[str, Any]] = {}
        self._generation = 0
        self._restart_lock: asyncio.Lock | None = None
        #: requests inside the engine now, and answered so far (the replica's heartbeat)
        self.in_flight = 0
        self.done = 0
        #: REQUEST_TALLY_ENV as the driver has it (None: not looked at; this process's then)
        self.request_tally: str | None = None
        self._tally: AppendFile | None = None  # its file, if asked
        #: the job's answer journal (a folder): each answer recorded is appended there the
        #: moment it is made, so a killed job's resume copies it (stages/answers.py)
        self.journal = ""
        self._journal: Journal | None = None

    def prepare(self) -> None:
        """In the driver, when the processor runs: what the engine's replicas share."""
        self.request_tally = os.environ.get(REQUEST_TALLY_ENV, "")
        self.engine.prepare()

    def begin(self) -> None:
        self.process_start_at = process_start()
        self.begin_at = time.time()
        self.engine.begin()  # the engine's start begins here (its fork server, vLLM's imports)

    async def start(self) -> None:
        # from begin() when it ran just before (the replica's start), else now (a later start)
        self.start_at = self.begin_at if self.begin_at and not self.start_at else time.time()
        await self.engine.start()
        self._ready_up()

    def adopt(self, engine: Engine, start_at: float | None = None) -> None:
        """Run on ``engine``, started already (a warm engine host's: :mod:`llmbatch.stages.warm`)
        instead of starting this stage's own; ``start_at``: when this run's wait for it began
        (now: a warm engine's start takes no time)."""
        self.engine = engine
        self.start_at = start_at or time.time()
        self._ready_up()

    def _ready_up(self) -> None:
        self.replica = f"{os.uname().nodename}:{os.getpid()}"  # the worker's, not the driver's
        self.devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")  # the GPUs Ray gave this replica
        limit = self.max_pending_requests
        if limit is None:
            limit = math.ceil(self.engine.capacity * 1.1)
        self._semaphore = asyncio.Semaphore(limit) if limit > 0 else None
        # groups of rows that must not share an engine step take turns (stages/turns.py)
        apart = self.lora_base_rows_apart
        if apart is None:
            apart = self.engine.base_rows_apart
        self._turns = Turns() if apart else None
        self._restart_lock = asyncio.Lock()
        self._known = load_known(self.known_answers)
        tally = os.environ.get(REQUEST_TALLY_ENV, "") if self.request_tally is None else self.request_tally
        if tally and self._tally is None:
            os.makedirs(tally, exist_ok=True)
            self._tally = AppendFile(tally)
        # a replica on another machine than the job's directory (a cluster without a shared file
        # system) has no journal: its answers are kept as they are committed
        if self.journal and self.answer_tag and self._journal is None and os.path.isdir(self.journal):
            self._journal = Journal(self.journal)
        self._ready = True
        self.ready_at = time.time()

    def seed(self, known_answers: Any, tag: str, journal: str = "") -> None:
        """A job's driver: copy these answers (by request digest) to identical requests, and
        record the answers this run computes under ``tag`` (stages/answers.py), appending each
        to the ``journal`` folder as it is made."""
        self.known_answers = known_answers
        self.answer_tag = tag
        self.journal = journal

    async def close(self) -> None:
        await self.engine.close()

    # -- one request -------------------------------------------------------------------------

    async def _restart(self, generation: int, exc: BaseException) -> None:
        async with self._restart_lock:
            if self._generation != generation:
                return  # another row already restarted it
            logger.warning("engine died (%s: %s); restarting replica %s", type(exc).__name__, exc, self.replica)
            try:
                await self.engine.restart()
            except EngineStartError:
                logger.exception("engine could not restart")
                raise
            self._generation += 1

    async def _run_once(self, request: Request) -> dict[str, Any]:
        if self._turns is None:
            return await self._admitted(request)
        await self._turns.enter("adapter" if request.lora is not None else "base")
        try:
            return await self._admitted(request)
        finally:
            self._turns.leave()

    async def _admitted(self, request: Request) -> dict[str, Any]:
        if self._semaphore is None:
            return await self._counted(request)
        async with self._semaphore:
            return await self._counted(request)

    async def _counted(self, request: Request) -> dict[str, Any]:
        if not self.first_request_at:
            self.first_request_at = time.time()
        self.in_flight += 1
        if self._tally is not None:
            self._tally.write(b".")
        try:
            return await self.engine.run(request)
        finally:
            self.in_flight -= 1
            self.done += 1

    async def _run(self, request: Request) -> dict[str, Any]:
        """Run a request, restarting the engine and retrying when it dies."""
        attempt = 0
        while True:
            generation = self._generation
            attempt += 1
            try:
                return await self._run_once(request)
            except Exception as exc:  # noqa: BLE001 - sorted below: fatal (retry) or the row's own error
                if not self.engine.is_fatal(exc):
                    raise
                if attempt >= self.max_attempts:
                    raise EngineDiedError(
                        f"the engine died {attempt} times while running this row "
                        f"(last: {type(exc).__name__}: {exc})"
                    ) from exc
                await self._restart(generation, exc)

    def _copy(self, request: Request) -> dict[str, Any] | None:
        """The answer of an identical request answered before (this job's or this replica's)."""
        key = request.key if self.dedup_requests else None
        if key in self._known:
            return self._known[key]
        if key in self._results:
            self._results.move_to_end(key)
            return self._results[key][0]
        return None

    async def _answer(self, request: Request) -> tuple[dict[str, Any], bool]:
        """The output for a request and whether it was copied from an identical one."""
        key = request.key if self.dedup_requests else None
        if key is None:
            return await self._run(request), False
        if (known := self._copy(request)) is not None:
            return known, True
        if key in self._inflight:
            return await asyncio.shield(self._inflight[key]), True
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            result = await self._run(request)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            self._inflight.pop(key, None)
        future.set_result(result)
        self._remember(key, result)
        return result, False

    def _remember(self, key: Any, result: dict[str, Any]) -> None:
        """Keep ``result`` for later identical requests, within :attr:`result_cache_bytes`."""
        size = result_size(result)
        if size > self.result_cache_bytes // 4:
            return
        self._results[key] = (result, size)
        self._results_bytes += size
        while self._results_bytes > self.result_cache_bytes and self._results:
            _, (_, dropped) = self._results.popitem(last=False)
            self._results_bytes -= dropped

    async def _process(self, row: Row, request: Request, batch_uuid: str) -> Row:
        try:
            result, copied = await self._answer(request)
        except Exception as exc:  # noqa: BLE001
            return self.fail(row, exc)
        return self._finish(row, request, result, copied, batch_uuid)

    def _finish(self, row: Row, request: Request, result: dict[str, Any], copied: bool, batch_uuid: str) -> Row:
        """The row with its answer (``copied`` from an identical request)."""
        answer, result = result, dict(result)
        spec = request.extra.get("structured")
        if spec and self.structured_output_errors != "off":
            try:
                check_structured(spec, result.get("generated_text", ""), result.get("finish_reason", ""))
            except StructuredOutputError as exc:
                if self.structured_output_errors == "error":
                    row.update(result)
                    return self.fail(row, exc, stage="check_output")
                result["structured_output_error"] = str(exc)
            else:
                if self.structured_output_errors == "warn":
                    result["structured_output_error"] = ""
        if self.answer_tag and not copied and isinstance(request.key, bytes):  # a digest (Serve's keys are text)
            row[ANSWER] = record = answer_record(self.answer_tag, request.key, answer)
            if record is not None and self._journal is not None:
                self._journal.append(record)
        cached = result.pop("num_cached_tokens", None)
        row.update(result)
        row["batch_uuid"] = batch_uuid
        row[ERROR_COLUMN] = ""
        row[STATS] = {"replica": self.replica, "devices": self.devices, "cached_tokens": cached, "deduped": copied,
                      "process_start_at": self.process_start_at, "begin_at": self.begin_at,
                      "start_at": self.start_at, "ready_at": self.ready_at, "first_request_at": self.first_request_at,
                      "restarts": self._generation, "finished_at": time.time(), "in_flight": self.in_flight}
        for key in ("sampling_params", "pooling_params", "tokenized_prompt"):
            row.pop(key, None)
        return row

    # -- a batch -----------------------------------------------------------------------------

    async def __call__(self, rows: list[Row]) -> AsyncIterator[list[Row]]:
        batch_uuid = uuid.uuid4().hex
        ready: list[Row] = []
        work: list[tuple[Row, Request]] = []
        for row in rows:
            if is_error(row) or not self.check_keys(row):
                ready.append(row)
                continue
            try:
                work.append((row, self.engine.build_request(row)))
            except Exception as exc:  # noqa: BLE001 - invalid request: this row's error, before the engine
                ready.append(self.fail(row, exc, stage="validate"))
        # rows whose identical request was answered before take its answer now, without a task
        # each: most rows of a job that repeats itself (issue 29)
        copies = [(row, request, self._copy(request)) for row, request in work]
        ready += [self._finish(row, request, known, True, batch_uuid) for row, request, known in copies if known is not None]
        work = [(row, request) for row, request, known in copies if known is None]
        if ready:
            yield ready
        if self.sort_by_prefix:
            work.sort(key=lambda item: _sortable(item[1].sort_key))
        tasks = [asyncio.ensure_future(self._process(row, req, batch_uuid)) for row, req in work]
        pending = set(tasks)
        buffer: list[Row] = []
        first_buffered = 0.0
        try:
            while pending:
                done, pending = await asyncio.wait(pending, timeout=self.flush_seconds,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if not buffer:
                        first_buffered = time.monotonic()
                    buffer.append(task.result())
                if buffer and (len(buffer) >= self.flush_rows or not pending
                               or time.monotonic() - first_buffered >= self.flush_seconds):
                    yield buffer
                    buffer = []
        finally:
            for task in pending:
                task.cancel()
        if buffer:
            yield buffer


def result_size(result: dict[str, Any]) -> int:
    """About how many bytes an answer takes in memory (text, token ids, logprobs, a pooled
    vector's array)."""
    size = 256
    for value in result.values():
        if isinstance(value, str):
            size += 49 + len(value)
        elif isinstance(value, np.ndarray):
            size += 112 + value.nbytes
        elif isinstance(value, (list, tuple)):
            size += 64 + 8 * len(value)
            if value and isinstance(value[0], (list, dict)):
                size += 120 * sum(len(v) if isinstance(v, (list, dict)) else 1 for v in value)
    return size


def _sortable(key: Any) -> tuple:
    """Token-id tuples and prompt strings sort together without comparing across types."""
    if isinstance(key, tuple):
        return (0, key, "")
    return (1, (), key or "")
