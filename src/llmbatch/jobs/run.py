"""Running a job: stage the input, run the processor over what is not done, commit, finish.

``run_job`` is the Python API behind ``llmbatch run``, ``resume`` and ``retry-errors``. The
driver reads the processor's output stream and commits it in parts; rows that arrive twice
(a task retried after a replica died) are dropped, and rows that never arrive are run again in
a follow-up pass, so every input id ends up exactly once in the output or in errors.jsonl.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from llmbatch.errors import EngineStartError, JobError, LLMBatchError, RowError
from llmbatch.jobs.prompts import check_prompt_fields
from llmbatch.jobs.spec import (
    JobSpec,
    config_hash,
    diff_fields,
    load_function,
    load_job,
    numerics_fields,
    redacted_spec,
    result_fields,
)
from llmbatch.jobs.store import FORMAT_VERSION, STAGE_ROWS, JobDir, atomic_write_json, input_fingerprint, same_input
from llmbatch.progress import Progress, check_report_dependencies, write_report
from llmbatch.redact import check_no_redacted, redact, redact_text
from llmbatch.rows import ERROR_COLUMN, PRIVATE_PREFIX, ROW_ID, STATS, parse_error
from llmbatch.codec import decode_rows, encode_rows, rows_to_table

logger = logging.getLogger(__name__)

#: Follow-up passes for rows lost in flight (a replica killed mid-batch) before they are
#: recorded as error rows.
MAX_PASSES = 3


@dataclass
class JobResult:
    """What a finished (or stopped) run left behind."""

    job_dir: Path
    state: str                      # "finished" | "stopped"
    output_path: str | None
    errors_path: Path
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.state == "finished"


# ---------------------------------------------------------------------------- processor


def build_job_processor(spec: JobSpec):
    """The processor a job runs: the spec's model, its prompt as preprocess, and the job's
    private columns (row id, per-row engine facts) kept for the driver."""
    from llmbatch.jobs.prompts import job_preprocess
    from llmbatch.processor import build_processor

    config = spec.processor_config()
    pre = job_preprocess(spec)
    post = load_function(spec.postprocess, spec.python_path) if spec.postprocess else None
    return build_processor(config, preprocess=pre, postprocess=post, keep_private=(ROW_ID, STATS),
                           encoded_output=True)


# ---------------------------------------------------------------------------- opening


def _new_meta(spec: JobSpec, fields: dict[str, Any], numerics: dict[str, Any]) -> dict[str, Any]:
    return {
        "version": FORMAT_VERSION,
        "created_at": time.time(),
        "spec": redacted_spec(spec),
        "result_fields": redact(fields),
        "numerics_fields": redact(numerics),
        "config_hash": config_hash(fields),
        "staged": False,
    }


def open_job(job: JobDir, spec: JobSpec, *, force: bool = False,
             allow_config_change: bool = False) -> dict[str, Any]:
    """Create the job in ``job`` (whose lock the caller holds), or check that the job already
    there is this one; returns its metadata."""
    fields = result_fields(spec)
    numerics = numerics_fields(spec)
    if job.exists() and force:
        job.reset()
    if not job.exists():
        meta = _new_meta(spec, fields, numerics)
        job.write_meta(meta)
        job.log(f"created job {job.root}")
        return meta
    meta = job.meta()
    if meta.get("version") != FORMAT_VERSION:
        raise JobError(f"{job.root} was made by another llmbatch format (v{meta.get('version')}); use --force to start over")
    if meta.get("config_hash") != config_hash(fields):
        changes = diff_fields(meta.get("result_fields", {}), redact(fields))
        if not allow_config_change:
            raise JobError(
                f"job {job.root} was started with a different config, which would change its results:\n  "
                + "\n  ".join(changes)
                + "\nResume with the original job file, run `llmbatch retry-errors` with --set to re-run only "
                  "the failed rows with the new settings, or pass --force to start over."
            )
        job.log("config changed for retry: " + "; ".join(changes))
        meta["result_fields"] = redact(fields)
        meta["config_hash"] = config_hash(fields)
        meta.setdefault("config_history", []).append({"at": time.time(), "kind": "result", "changes": changes})
    numerics_changes = diff_fields(meta.get("numerics_fields", {}), redact(numerics))
    if numerics_changes and meta.get("staged"):
        note = ("settings that can change greedy answers through batching or kernels changed since the job "
                "started (" + "; ".join(numerics_changes) + "); rows answered before and after may differ in "
                "near-ties. Recorded in job.json config_history.")
        logger.warning("job %s: %s", job.root, note)
        job.log("warning: " + note)
        meta.setdefault("config_history", []).append({"at": time.time(), "kind": "numerics",
                                                      "changes": numerics_changes})
    meta["numerics_fields"] = redact(numerics)
    if meta.get("staged"):
        same, why = same_input(meta["input_fingerprint"], spec.input.path)
        if not same:
            raise JobError(f"cannot resume {job.root}: {why}. Point the job at the original input, "
                           "or pass --force to start over with the new one.")
    meta["spec"] = redacted_spec(spec)
    job.write_meta(meta)
    return meta


def _stage(job: JobDir, spec: JobSpec, meta: dict[str, Any]) -> dict[str, Any]:
    job.log(f"staging input {redact_text(spec.input.path)}")
    fingerprint = input_fingerprint(spec.input.path)
    info = job.stage(spec.input.path, spec.input.format, spec.input.columns, spec.input.limit, spec.input.id_column)
    check_prompt_fields(spec, info["columns"])
    meta.update(staged=True, rows=info["rows"], columns=info["columns"], column_types=info["column_types"],
                stage_rows=STAGE_ROWS, input_fingerprint=fingerprint)
    job.write_meta(meta)
    job.log(f"staged {info['rows']:,} rows")
    return meta


# ---------------------------------------------------------------------------- committing


class Committer:
    """Buffers the output stream and commits it in parts; drops rows already committed."""

    def __init__(self, job: JobDir, done: np.ndarray, progress: Progress, commit_rows: int, commit_seconds: float):
        self.job = job
        self.done = done
        self.progress = progress
        self.commit_rows = commit_rows
        self.commit_seconds = commit_seconds
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.last_commit = time.monotonic()
        self.duplicates = 0
        self.json_columns: set[str] = {"messages"}

    def add(self, encoded: pa.Table) -> None:
        if encoded.num_rows == 0:
            return
        table = rows_to_table(decode_rows(encoded), self.json_columns)
        self.progress.arrived()
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
            return
        self.done[table.column(ROW_ID).to_numpy()] = True
        self.buffer.append(table)
        self.buffered += table.num_rows
        if self.buffered >= self.commit_rows or time.monotonic() - self.last_commit >= self.commit_seconds:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        try:
            table = pa.concat_tables(self.buffer, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            from llmbatch.io.writers import conform, unify_schema

            names = list(dict.fromkeys(n for t in self.buffer for n in t.column_names))
            schema = unify_schema([t.schema for t in self.buffer], names)
            table = pa.concat_tables([conform(t, schema) for t in self.buffer])
        self.job.commit(table)
        self.buffer = []
        self.buffered = 0
        self.last_commit = time.monotonic()
        self.progress.add(**_counts(table))


def _counts(table: pa.Table) -> dict[str, Any]:
    errors = table.column(ERROR_COLUMN).to_pylist() if ERROR_COLUMN in table.column_names else [""] * table.num_rows
    n_err = sum(1 for e in errors if e)
    types = collections.Counter(f"{parse_error(e)[0]}: {parse_error(e)[1]}" for e in errors if e)
    inputs = table.column("num_input_tokens").to_pylist() if "num_input_tokens" in table.column_names else []
    outputs = (table.column("num_generated_tokens").to_pylist() if "num_generated_tokens" in table.column_names
               else [0] * table.num_rows)
    stats = table.column(STATS).to_pylist() if STATS in table.column_names else [None] * table.num_rows
    cached = deduped = generated = 0
    replicas: collections.Counter[str] = collections.Counter()
    for s, out in zip(stats, outputs):
        copied = bool(s and s.get("deduped"))
        generated += 0 if copied else int(out or 0)
        if s:
            cached += int(s.get("cached_tokens") or 0)
            deduped += int(copied)
            replicas[s.get("replica") or "?"] += 1
    return {"ok": table.num_rows - n_err, "errors": n_err, "in_tokens": int(sum(v for v in inputs if v)),
            "generated_tokens": generated, "delivered_tokens": int(sum(v for v in outputs if v)),
            "cached_tokens": cached, "deduped": deduped, "error_types": dict(types), "replicas": dict(replicas)}


# ---------------------------------------------------------------------------- running


def _todo_dataset(job: JobDir, meta: dict[str, Any], todo: np.ndarray):
    """The staged rows still to do, as a Ray Dataset of encoded rows (one block per staged
    file; the processor cuts it into blocks of one engine batch)."""
    import ray
    import ray.data

    stage_rows = meta.get("stage_rows", STAGE_ROWS)
    files = []
    for path in job.staged_files():
        k = int(path.stem.split("-")[1])
        if todo[k * stage_rows:(k + 1) * stage_rows].any():
            files.append(str(path))
    todo_ref = ray.put(todo)

    def load(batch: pa.Table) -> pa.Table:
        mask = _todo_mask(todo_ref)
        rows = [row for path in batch.column("path").to_pylist()
                for row in JobDir.staged_rows(Path(path)) if mask[row[ROW_ID]]]
        return encode_rows(rows)

    ds = ray.data.from_items([{"path": f} for f in files], override_num_blocks=max(1, len(files)))
    return ds.map_batches(load, batch_size=1, batch_format="pyarrow", zero_copy_batch=True)


_TODO_CACHE: dict[str, np.ndarray] = {}


def _todo_mask(ref) -> np.ndarray:
    import ray

    key = ref.hex()
    if key not in _TODO_CACHE:
        _TODO_CACHE.clear()
        _TODO_CACHE[key] = ray.get(ref)
    return _TODO_CACHE[key]


def _run_pass(job: JobDir, spec: JobSpec, meta: dict[str, Any], todo: np.ndarray, done: np.ndarray,
              progress: Progress) -> None:
    processor = build_job_processor(spec)
    ds = _todo_dataset(job, meta, todo)
    out = processor(ds)
    committer = Committer(job, done, progress, spec.commit_rows, spec.commit_seconds)
    try:
        for table in out.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
            committer.add(table)
    finally:
        committer.flush()
        if committer.duplicates:
            job.log(f"dropped {committer.duplicates} repeated rows (retried tasks)")


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


def _record_lost(job: JobDir, meta: dict[str, Any], missing: np.ndarray, done: np.ndarray, progress: Progress) -> None:
    """Rows that never came back after every pass: error rows, so nothing is silently lost."""
    ids = np.flatnonzero(missing)
    message = f"engine: RowLostError: the row did not come back after {MAX_PASSES} passes (replicas kept failing)"
    rows = []
    for path in job.staged_files():
        for row in JobDir.staged_rows(path, ids):
            row[ERROR_COLUMN] = message
            rows.append({k: v for k, v in row.items() if not k.startswith(PRIVATE_PREFIX) or k == ROW_ID})
    if rows:
        table = rows_to_table(rows)
        job.commit(table)
        done[ids] = True
        progress.add(**_counts(table))


def _execute(job_dir: JobDir, spec: JobSpec, meta: dict[str, Any], todo: np.ndarray, done: np.ndarray,
             progress: Progress) -> None:
    """Run passes until every row is committed (or recorded as lost); translate failures."""
    from llmbatch.cluster import ensure_ray

    # worker output (engine start-up chatter) goes to Ray's log files, not the terminal
    ensure_ray(log_to_driver=False)
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # llmbatch shows its own progress
    ctx.issue_detectors_config.detectors = []
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    for attempt in range(MAX_PASSES):
        if attempt:
            job_dir.log(f"pass {attempt + 1}: {int(todo.sum())} rows did not come back; running them again")
        try:
            _run_pass(job_dir, spec, meta, todo, done, progress)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - translated when we know what it is
            explained = explain_failure(exc)
            if explained is None:
                job_dir.log(f"failed: {type(exc).__name__}: {exc}")
                raise
            if isinstance(explained, RowError):
                explained = JobError(
                    f"the job stopped at a bad row (continue_on_error is off): {explained}. Rows answered "
                    "before it are committed; fix the row or set continue_on_error: true, then resume.")
            job_dir.log(f"failed: {explained}")
            raise explained from exc
        todo = ~done
        if not todo.any():
            return
    _record_lost(job_dir, meta, todo, done, progress)


def _install_sigterm() -> Any:
    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def run_job(job: JobSpec | str | os.PathLike, *, overrides: list[str] | None = None, force: bool = False,
            retry_errors: bool = False, report: bool = False, quiet: bool = False,
            tty: bool | None = None) -> JobResult:
    """Run (or resume) a job to the end; returns where the results are.

    ``job`` is a :class:`JobSpec`, a job file, or a job directory (to resume that directory,
    wherever it was moved). ``retry_errors`` re-runs only the rows that failed (``overrides``
    may change the config for them). Ctrl-C stops cleanly: what was answered is committed and
    ``resume`` continues. Nothing in the job directory changes before its lock is held.
    """
    spec = _resolve_spec(job, overrides)
    if report:
        check_report_dependencies()
    job_dir = JobDir(spec.resolved_job_dir())
    with job_dir.locked():
        meta = open_job(job_dir, spec, force=force, allow_config_change=retry_errors)
        return _run_locked(job_dir, spec, meta, retry_errors=retry_errors, report=report, quiet=quiet, tty=tty)


def _run_locked(job_dir: JobDir, spec: JobSpec, meta: dict[str, Any], *, retry_errors: bool, report: bool,
                quiet: bool, tty: bool | None) -> JobResult:
    job_dir.clean_temporaries()
    if not meta.get("staged"):
        meta = _stage(job_dir, spec, meta)
    else:
        check_prompt_fields(spec, meta["columns"])
    state = job_dir.state(meta["rows"])
    done = state.done.copy()
    if retry_errors:
        done &= ~state.error
    counts = state.counts()
    todo = ~done
    progress = Progress(meta["rows"], done_before=int(done.sum()),
                        errors_before=counts["errors"] if not retry_errors else 0,
                        progress_path=job_dir.progress_path, tty=tty, quiet=quiet)
    mode = "retry-errors" if retry_errors else ("resume" if counts["done"] else "run")
    job_dir.log(f"{mode}: {int(todo.sum()):,} rows to do of {meta['rows']:,}")
    old_sigterm = _install_sigterm()
    state_name = "finished"
    run_info: dict[str, Any] = {}
    started = time.time()
    progress.start()
    try:
        if todo.any():
            _execute(job_dir, spec, meta, todo, done, progress)
    except KeyboardInterrupt:
        state_name = "stopped"
        job_dir.log("stopped by signal; committed rows are kept, run `llmbatch resume` to continue")
    except BaseException:
        state_name = "failed"
        raise
    finally:
        snap = progress.stop(state_name)
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
        run_info = {"mode": mode, "started_at": started, "ended_at": time.time(), "state": state_name,
                    **snap["this_run"]}
        meta.setdefault("runs", []).append(run_info)
        job_dir.write_meta(meta)
    if state_name != "finished":
        return JobResult(job_dir.root, state_name, None, job_dir.errors_path, snap)
    from llmbatch.jobs.output import finish

    try:
        stats = finish(job_dir, spec, meta, run_info, progress)
    except KeyboardInterrupt:  # every row is committed; `resume` writes the output again
        run_info["state"] = "stopped"
        job_dir.write_meta(meta)
        snap = progress.mark("stopped")
        job_dir.log("stopped while writing the output; run `llmbatch resume` to write it")
        return JobResult(job_dir.root, "stopped", None, job_dir.errors_path, snap)
    if report:
        stats["report"] = str(write_report(progress.timeline, job_dir.root / "report.png"))
        atomic_write_json(job_dir.stats_path, stats)
    job_dir.log(f"finished: {stats['rows_ok']:,} rows answered, {stats['rows_error']:,} errors")
    return JobResult(job_dir.root, "finished", stats["output"], job_dir.errors_path, stats)


def _resolve_spec(job: JobSpec | str | os.PathLike, overrides: list[str] | None) -> JobSpec:
    if isinstance(job, JobSpec):
        if overrides:
            data = json.loads(job.model_dump_json())
            return load_job(data=data, overrides=overrides)
        return job
    path = Path(job)
    if path.is_dir():
        # resume the directory given, wherever it is now (it may have been moved or restored)
        data = JobDir(path).meta()["spec"]
        data["job_dir"] = str(path.resolve())
        check_no_redacted(data, path)
        return load_job(data=data, overrides=overrides)
    return load_job(path, overrides)
