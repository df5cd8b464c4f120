"""Driving a job's processor: passes over the rows still to do, committing as answers arrive.

The driver reads the processor's output stream and commits it in parts; rows that arrive twice
(a task retried after a replica died) are dropped, and rows that never arrive are run again in
a follow-up pass, so every input id ends up exactly once in the output or in errors.jsonl.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from llmbatch.builders import build_layout
from llmbatch.cluster import ensure_ray
from llmbatch.codec import JOB_JSON_COLUMNS, STATE_COLUMN, decode_rows, rows_to_table
from llmbatch.errors import EngineStartError, JobError, LLMBatchError, RowError
from llmbatch.io.writers import conform, unify_schema
from llmbatch.jobs.fold import BUILD_SLICE, Fold
from llmbatch.jobs.identity import config_hash
from llmbatch.jobs.ingest import INGEST_ROWS, input_rows, todo_dataset
from llmbatch.jobs.job import Job
from llmbatch.jobs.output import first_part_check
from llmbatch.jobs.store import JobDir, committed_answers
from llmbatch.jobs.tally import Tally
from llmbatch.processor import Processor
from llmbatch.progress import Progress
from llmbatch.rows import ANSWER, ERROR_COLUMN, PRIVATE_PREFIX, ROW_ID, STATS
from llmbatch.stages.output import OutputStage

logger = logging.getLogger(__name__)

#: Follow-up passes for rows lost in flight (a replica killed mid-batch) before they are
#: recorded as error rows.
MAX_PASSES = 3
#: Commits handed to the part writer that may be in its hands at once: the stream decodes and
#: folds the next answers while the disk takes the last parts (a part's write and its fsyncs
#: release the GIL), and no more than this many flushes wait in memory.
WRITE_AHEAD = 2


def build_job_processor(job: Job) -> Processor:
    """The processor a job runs: its config, its kind's preprocess (the prompt) and
    postprocess, and an output stage that keeps the job's private columns (row id, per-row
    engine facts) for the driver."""
    return Processor(job.config, build_layout(job.config, preprocess=job.preprocess(), postprocess=job.postprocess(),
                                              output=job_output()))


def job_output() -> OutputStage:
    """The output stage of a job's processor (unbound: the layout binds it): the private
    columns the driver needs, rows typed in the replicas as the driver commits them."""
    return OutputStage(keep_private=(ROW_ID, STATS, ANSWER), for_job=True)


def answer_tag(job: Job) -> str:
    """What the job's answer records are valid for: the model settings that decide an answer
    (the request's digest covers the prompt, sampling params and adapter). Settings that only
    move near-ties (batch sizes, concurrency: ``resume`` "numerics") keep the records valid, as
    they keep a resumed job's committed rows: a job resumed on more GPUs copies what it has."""
    return config_hash({k: v for k, v in job.result_fields.items() if k.startswith("model.")})


def seed_answers(processor: Processor, job: Job) -> None:
    """Give the processor's engine stage the answers the job's committed rows recorded, and
    have it record this run's (stages/answers.py)."""
    import ray

    tag = answer_tag(job)
    known = committed_answers(job.dir, tag)
    job.dir.journal_dir.mkdir(exist_ok=True)
    processor.layout.engine.seed(ray.put(known) if known else None, tag, str(job.dir.journal_dir))
    if known:
        job.log(f"{len(known)} answers the job has (committed rows, the answer journal) are copied to "
                "identical requests, not sent again")


class Committer:
    """Buffers the output stream and commits it in parts; drops rows already committed."""

    def __init__(self, job: JobDir, done: np.ndarray, progress: Progress, commit_rows: int, commit_seconds: float,
                 fold: Fold | None = None, check: Callable[[pa.Table], bool] | None = None):
        self.job = job
        self.fold = fold
        self.check = check  # of the first committed part with answers (output.first_part_check)
        self.done = done
        self.progress = progress
        self.commit_rows = commit_rows
        self.commit_seconds = commit_seconds
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.last_commit = time.monotonic()
        self.duplicates = 0
        # columns of free-form JSON (an endpoint's whole answer) are kept as JSON text (rows that
        # come encoded; the replicas' output stage types theirs alike: stages/output.py)
        self.json_columns: set[str] = set(JOB_JSON_COLUMNS)
        self._lock = threading.Lock()  # the stream's thread adds, the timer's commits
        # parts are written on a thread of their own, in order (see WRITE_AHEAD)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmbatch-parts")
        self._writes: deque[Future] = deque()
        #: seconds the stream's thread spent on answers (decoding, folding, handing parts over) and
        #: the writer on parts (stats.json ``driver_s``: is the driver what the rows wait for?)
        self.busy = {"answers": 0.0, "parts": 0.0}

    def add(self, batch: pa.Table) -> None:
        """One batch of the processor's output: typed rows (the job's output stage types them in
        the replicas), or rows still encoded."""
        if batch.num_rows == 0:
            return
        began = time.perf_counter()
        table = rows_to_table(decode_rows(batch), self.json_columns) if STATE_COLUMN in batch.column_names else batch
        with self._lock:
            self._add(table)
        self.busy["answers"] += time.perf_counter() - began

    def _add(self, table: pa.Table) -> None:
        self.progress.arrived()
        table = self._keep(table)
        if table is None:
            return
        if self.fold is not None:
            for followers in self.fold.answered(table, self.done, limit=BUILD_SLICE):
                self._keep(followers)
        if self.buffered >= self.commit_rows or time.monotonic() - self.last_commit >= self.commit_seconds:
            self._flush()

    def _keep(self, table: pa.Table) -> pa.Table | None:
        """Buffer the rows of ``table`` not committed before (nor twice in it); what was kept."""
        ids = table.column(ROW_ID).to_numpy()
        fresh = ~self.done[ids]
        _, first = np.unique(ids, return_index=True)
        once = np.zeros(len(ids), dtype=bool)
        once[first] = True
        keep = fresh & once
        self.duplicates += int((~keep).sum())
        if not keep.all():
            table = table.filter(pa.array(keep))
        if table.num_rows == 0:
            return None
        self.done[table.column(ROW_ID).to_numpy()] = True
        self.buffer.append(table)
        self.buffered += table.num_rows
        return table

    def flush(self) -> None:
        """Commit everything: what waits and every follower whose answer is here (the end of
        the stream); returns once every part is written."""
        with self._lock:
            self._flush(final=True)
            self._settle(0)

    def wait_written(self) -> None:
        """Wait until every part handed to the writer is on disk (a write that failed raises)."""
        with self._lock:
            self._settle(0)

    def close(self) -> None:
        """Wait for the parts in the writer's hands and end its thread."""
        try:
            self.wait_written()
        finally:
            self._writer.shutdown(wait=True)

    def _settle(self, ahead: int) -> None:
        """Wait until at most ``ahead`` commits are in the writer's hands; a commit that failed
        raises here (so the stream stops at the first part that could not be written)."""
        while self._writes and (len(self._writes) > ahead or self._writes[0].done()):
            self._writes.popleft().result()

    def _write(self, parts: list[pa.Table], table: pa.Table) -> None:
        began = time.perf_counter()
        self.job.commit_parts(parts)
        self.progress.add(**Tally.of(table).progress_counts())
        if self.check is not None and self.check(table):  # (raises for the stream where it fails)
            self.check = None
        self.busy["parts"] += time.perf_counter() - began

    def flush_due(self) -> None:
        """Commit what waits once ``commit_seconds`` have passed, also when no batch arrives:
        rows answered before a long last batch must not wait for it uncommitted."""
        with self._lock:
            due = time.monotonic() - self.last_commit >= self.commit_seconds
            if due and (self.buffer or self.fold is not None):
                self._flush()

    @contextlib.contextmanager
    def timer(self) -> Iterator[None]:
        """While the stream runs: :meth:`flush_due` on a thread, every half ``commit_seconds``
        (at most every second)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(max(0.05, min(self.commit_seconds / 2, 1.0))):
                try:
                    self.flush_due()
                except Exception as exc:  # noqa: BLE001 - the stream's own commit raises it again
                    logger.warning("a timed commit failed (%s: %s); commits wait for the next answers",
                                   type(exc).__name__, exc)
                    return

        thread = threading.Thread(target=loop, name="llmbatch-commit", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=60)

    def _flush(self, final: bool = False) -> None:
        # the followers whose answers are here go with this commit: all of them at the end, else
        # a slice (the answers waiting behind them go first: see fold.BUILD_SLICE); the rows in
        # the buffer before them (the answered rows themselves) are committed first
        if self.fold is not None:
            for followers in self.fold.emit(self.done, everything=True, limit=None if final else BUILD_SLICE):
                self._keep(followers)
        if not self.buffer:
            return
        try:
            table = pa.concat_tables(self.buffer, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            names = list(dict.fromkeys(n for t in self.buffer for n in t.column_names))
            schema = unify_schema([t.schema for t in self.buffer], names)
            table = pa.concat_tables([conform(t, schema) for t in self.buffer])
        # a part holds commit_rows rows at most, however many came at once (a block of several
        # batches leaves together)
        parts = [table.slice(start, self.commit_rows) for start in range(0, table.num_rows, self.commit_rows)]
        self._writes.append(self._writer.submit(self._write, parts, table))
        self.buffer = []
        self.buffered = 0
        self.last_commit = time.monotonic()
        self._settle(WRITE_AHEAD)


def _run_pass(job: Job, todo: np.ndarray, done: np.ndarray, progress: Progress) -> None:
    processor = build_job_processor(job)
    seed_answers(processor, job)
    fold = fold_rows(job, todo)
    out = processor(todo_dataset(job, todo if fold is None else fold.send))
    progress.watch_replicas(processor.run_id)  # the start-up phase, from the replicas' heartbeats
    committer = Committer(job.dir, done, progress, job.spec.commit_rows, job.spec.commit_seconds, fold,
                          first_part_check(job))
    waited, since = 0.0, None  # the stream's idle time between answers (after the first)
    try:
        with committer.timer():
            for table in out.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
                if since is not None:
                    waited += time.perf_counter() - since
                committer.add(table)
                since = time.perf_counter()
    finally:
        try:
            committer.flush()
        finally:
            committer.close()
            spent = progress.marks.setdefault("driver_s", {"waiting": 0.0, "answers": 0.0, "parts": 0.0})
            for name, seconds in (("waiting", waited), *committer.busy.items()):
                spent[name] = round(spent[name] + seconds, 6)  # (a 12-row job's answers take a millisecond)
        if committer.duplicates:
            job.log(f"dropped {committer.duplicates} repeated rows (retried tasks)")


def fold_rows(job: Job, todo: np.ndarray) -> Fold | None:
    """The pass's groups of identical rows (``jobs.fold``), where the job's rows can fold."""
    columns = job.kind.fold_columns(job)
    if not columns:
        return None
    fold = Fold(job.dir.input_files(), job.meta.ingest_rows or INGEST_ROWS, todo, columns)
    if fold.followers:
        job.log(f"{int(fold.send.sum())} of {int(todo.sum())} rows go to the engine: the other {fold.followers} "
                f"ask what one of them asks ({', '.join(columns)} equal) and take its answer")
    return fold


def explain_failure(exc: BaseException) -> LLMBatchError | None:
    """The llmbatch error behind a pipeline failure (Ray wraps errors raised in workers)."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, LLMBatchError):
            return e
        todo.extend([getattr(e, "cause", None), e.__cause__, e.__context__])
    text = str(exc)
    for name, cls in (("EngineStartError", EngineStartError), ("RowError", RowError)):
        marker = f"{name}: "
        if marker in text:
            detail = text.split(marker, 1)[1].strip().splitlines()[0]
            return cls(detail) if cls is EngineStartError else JobError(f"a row failed: {detail}")
    return None


def _record_lost(job: JobDir, missing: np.ndarray, done: np.ndarray, progress: Progress) -> None:
    """Rows that never came back after every pass: error rows, so nothing is silently lost."""
    ids = np.flatnonzero(missing)
    message = f"engine: RowLostError: the row did not come back after {MAX_PASSES} passes (replicas kept failing)"
    rows = []
    for path in job.input_files():
        for row in input_rows(path, ids):
            row[ERROR_COLUMN] = message
            rows.append({k: v for k, v in row.items() if not k.startswith(PRIVATE_PREFIX) or k == ROW_ID})
    if rows:
        table = rows_to_table(rows)
        job.commit(table)
        done[ids] = True
        progress.add(**Tally.of(table).progress_counts())


@contextlib.contextmanager
def quiet_ray_data() -> Iterator[None]:
    """Ray Data's own progress bars, issue detectors and info logs off while the job shows its
    own progress; everything is put back after."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    saved = (ctx.enable_progress_bars, list(ctx.issue_detectors_config.detectors))
    loggers = {name: logging.getLogger(name) for name in ("ray.data", "ray.data._internal.progress")}
    levels = {name: lg.level for name, lg in loggers.items()}
    ctx.enable_progress_bars = False
    ctx.issue_detectors_config.detectors = []
    loggers["ray.data"].setLevel(logging.WARNING)
    loggers["ray.data._internal.progress"].setLevel(logging.ERROR)
    try:
        yield
    finally:
        ctx.enable_progress_bars, ctx.issue_detectors_config.detectors = saved
        for name, lg in loggers.items():
            lg.setLevel(levels[name])


def execute(job: Job, todo: np.ndarray, done: np.ndarray, progress: Progress) -> None:
    """Run passes until every row is committed (or recorded as lost); translate failures."""
    # worker output (engine start-up chatter) goes to Ray's log files, not the terminal
    progress.set_phase("starting Ray")
    ensure_ray(log_to_driver=False)
    progress.marks.setdefault("ray_ready", time.time())
    with quiet_ray_data():
        for attempt in range(MAX_PASSES):
            if attempt:
                job.log(f"pass {attempt + 1}: {int(todo.sum())} rows did not come back; running them again")
            try:
                _run_pass(job, todo, done, progress)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - translated when we know what it is
                explained = explain_failure(exc)
                if explained is None:
                    job.log(f"failed: {type(exc).__name__}: {exc}")
                    raise
                if isinstance(explained, RowError):
                    explained = JobError(
                        f"the job stopped at a bad row (continue_on_error is off): {explained}. Rows answered "
                        "before it are committed; fix the row or set continue_on_error: true, then resume.")
                job.log(f"failed: {explained}")
                raise explained from exc
            todo = ~done
            if not todo.any():
                return
        _record_lost(job.dir, todo, done, progress)
