"""Running a job: take its lock, open or check its directory, read the input once, drive the
processor over what is not done (``jobs.driver``), then write the output (``jobs.output``).

``run_job`` is the Python API behind ``llmbatch run``, ``resume`` and ``retry-errors``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmbatch.builders import vllm_settings
from llmbatch.cluster import RayStart
from llmbatch.config import vLLMEngineProcessorConfig
from llmbatch.engines import vllm_early
from llmbatch.env import env_number
from llmbatch.errors import ConfigError, JobError, LLMBatchError
from llmbatch.io.files import atomic_write_json
from llmbatch.jobs.driver import execute
from llmbatch.jobs.identity import config_hash, diff_fields
from llmbatch.jobs.ingest import INGEST_ROWS, ingest
from llmbatch.jobs.job import Job
from llmbatch.jobs.kinds import job_for
from llmbatch.jobs.meta import JobMeta
from llmbatch.jobs.output import finish
from llmbatch.jobs.preflight import (
    INPUT,
    check_job,
    discard_unstarted,
    first_missing,
    remove_created,
)
from llmbatch.jobs.spec import JobSpec, load_job, redacted_spec
from llmbatch.jobs.store import JobDir, input_files, input_fingerprint, job_dir_beside, same_input
from llmbatch.progress import Progress
from llmbatch.redact import check_no_redacted, redact, redact_text
from llmbatch.report import check_report_dependencies, write_report
from llmbatch.terminal import Terminal, job_terminal

logger = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------------- opening


def open_job(opened: Job, *, force: bool = False, allow_config_change: bool = False) -> JobMeta:
    """Create the job in its directory (whose lock the caller holds), or check that the job
    already there is this one; returns its metadata (also ``opened.meta``)."""
    opened.meta = _open(opened.dir, opened.spec, opened.result_fields, opened.numerics_fields, force=force,
                        allow_config_change=allow_config_change)
    return opened.meta


def _open(job: JobDir, spec: JobSpec, fields: dict[str, Any], numerics: dict[str, Any], *, force: bool,
          allow_config_change: bool) -> JobMeta:
    if job.exists() and (force or not _started(job)):
        job.reset()  # (a job that never read its input, e.g. stopped at an invalid line, has nothing to keep)
    if not job.exists():
        meta = JobMeta(spec=redacted_spec(spec), result_fields=redact(fields), numerics_fields=redact(numerics),
                       config_hash=config_hash(fields))
        job.write_meta(meta)
        job.log(f"created job {job.root}")
        return meta
    meta = job.meta()
    if meta.config_hash != config_hash(fields):
        changes = diff_fields(meta.result_fields, redact(fields))
        if not allow_config_change:
            raise JobError(
                f"job {job.root} was started with a different config, which would change its results:\n  "
                + "\n  ".join(changes)
                + "\nResume with the original job file, run `llmbatch retry-errors` with --set to re-run only "
                  "the failed rows with the new settings, or pass --force to start over."
            )
        job.log("config changed for retry: " + "; ".join(changes))
        meta.result_fields = redact(fields)
        meta.config_hash = config_hash(fields)
        meta.config_history.append({"at": time.time(), "kind": "result", "changes": changes})
    numerics_changes = diff_fields(meta.numerics_fields, redact(numerics))
    if numerics_changes and meta.ingested:
        note = ("settings that can change greedy answers through batching or kernels changed since the job "
                "started (" + "; ".join(numerics_changes) + "); rows answered before and after may differ in "
                "near-ties. Recorded in job.json config_history.")
        logger.warning("job %s: %s", job.root, note)
        job.log("warning: " + note)
        meta.config_history.append({"at": time.time(), "kind": "numerics", "changes": numerics_changes})
    meta.numerics_fields = redact(numerics)
    if meta.ingested:
        same, why = same_input(meta.input_fingerprint, spec.input.path)
        if not same:
            raise JobError(f"cannot resume {job.root}: {why}. Point the job at the original input, "
                           "or pass --force to start over with the new one.")
    meta.spec = redacted_spec(spec)
    job.write_meta(meta)
    return meta


def process_start_time() -> float | None:
    """When this process started (the clock a user's wait starts on), or None if unknown."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a figure, never a failure
        return None


def _started(job: JobDir) -> bool:
    try:
        return job.meta().ingested
    except JobError:
        return True


#: An input of at least this many bytes (or a remote one) is read while Ray starts beside the
#: read (``cluster.RayStart``); a smaller one reads in well under Ray's start, which then starts
#: when the rows need it, so that a mistake found in a small input never starts Ray.
#: ``LLMBATCH_RAY_BESIDE_INPUT_BYTES`` sets another size (0: always beside the read).
LONG_READ_BYTES = 16 * 2**20
LONG_READ_ENV = "LLMBATCH_RAY_BESIDE_INPUT_BYTES"


def _bytes(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError(raw)
    return value


def _long_read(path: str) -> bool:
    least = env_number(LONG_READ_ENV, LONG_READ_BYTES, _bytes, "a whole number of bytes", "16777216")
    if "://" in path or least == 0:
        return True
    try:
        return sum(os.path.getsize(f) for f in input_files(path)) >= least
    except OSError:
        return False  # the read reports what is missing


def read_input(job: Job) -> JobMeta:
    """Read the job's input once into its directory (``jobs.ingest``), as its kind reads it."""
    spec, meta = job.spec, job.meta
    job.log(f"reading input {redact_text(spec.input.path)}")
    fingerprint = input_fingerprint(spec.input.path)
    job.kind.check_input(job)
    info = ingest(job.dir, spec.input.path, spec.input.format, spec.input.columns, spec.input.limit,
                  spec.input.id_column, job.kind.read(job), job.kind.read_tables(job))
    if not info["rows"]:
        raise ConfigError(f"{INPUT}: the input has no {job.kind.holds}: {spec.input.path} holds none")
    job.kind.check_columns(job, info["columns"])
    meta.ingested = True
    meta.rows, meta.columns, meta.column_types = info["rows"], info["columns"], info["column_types"]
    meta.ingest_rows, meta.input_fingerprint = INGEST_ROWS, fingerprint
    job.dir.write_meta(meta)
    job.log(f"read {info['rows']:,} rows")
    return meta


# ---------------------------------------------------------------------------- running


def _install_sigterm() -> Any:
    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def launch_engine(job: Job) -> None:
    """Launch the job's vLLM engine now, before Ray and its replica exist, where its one replica
    can attach to it (``engines/vllm_early.py``): not for warm engines, placement groups, LoRA
    adapters or engine metrics (their engines start in the replica as before)."""
    config = job.config
    if (isinstance(config, vLLMEngineProcessorConfig) and not config.resolved_keep_warm_s()
            and not config.placement_group_config and not config.dynamic_lora_loading_path
            and not config.log_engine_metrics):
        vllm_early.launch(vllm_settings(config))


def run_job(job: JobSpec | dict | str | os.PathLike, *, overrides: list[str] | None = None, force: bool = False,
            retry_errors: bool = False, report: bool = False, quiet: bool = False,
            tty: bool | None = None) -> JobResult:
    """Run (or resume) a job to the end; returns where the results are.

    ``job`` is a :class:`JobSpec`, a dict of a job file's sections (``{"input": {...}, "model":
    {...}, ...}``), a job file, or a job directory (to resume that directory, wherever it was moved). ``retry_errors`` re-runs only the rows that failed (``overrides``
    may change the config for them). Ctrl-C stops cleanly: what was answered is committed and
    ``resume`` continues. Nothing in the job directory changes before its lock is held. While
    it runs, Ray's and vLLM's INFO and WARNING lines go to the job's log.txt, not the terminal
    (``llmbatch.terminal``).
    """
    entered = time.time()
    opened = job_for(resolve_spec(job, overrides))
    if report:
        check_report_dependencies()
    job_dir = opened.dir
    check_job(opened, force=force)  # before anything is created or started
    created = first_missing(job_dir.root)
    discarded = False
    try:
        with job_dir.locked():
            try:
                open_job(opened, force=force, allow_config_change=retry_errors)
                with job_terminal(job_dir.log_path) as terminal:  # Ray's and vLLM's lines to log.txt
                    try:
                        return _run_locked(opened, retry_errors=retry_errors, report=report,
                                           quiet=quiet, tty=tty, entered=entered, terminal=terminal)
                    finally:  # however the run ends (a failed read too), an engine launched for it stops
                        vllm_early.stop_all()
            except LLMBatchError:  # a mistake found while reading the input leaves nothing behind
                discarded = discard_unstarted(job_dir, created)
                raise
    finally:
        if discarded:
            remove_created(job_dir, created)


def _run_locked(job: Job, *, retry_errors: bool, report: bool, quiet: bool, tty: bool | None, entered: float,
                terminal: Terminal) -> JobResult:
    job_dir, meta = job.dir, job.meta
    job_dir.clean_temporaries()
    ingest_s = None
    ray_start = None
    if not meta.ingested:
        launch_engine(job)  # vLLM's engine starts beside the read, Ray's start and the replica's
        # Ray starts beside a long first read of the input (a large or remote one)
        ray_start = RayStart(log_to_driver=False) if _long_read(job.spec.input.path) else None
        ingest_began = time.time()
        try:
            read_input(job)
        except BaseException:
            if ray_start is not None:
                ray_start.abandon()
            raise
        ingest_s = time.time() - ingest_began
    else:
        job.kind.check_columns(job, meta.columns)
    state = job_dir.state(meta.rows)
    done = state.done.copy()
    if retry_errors:
        done &= ~state.error
    counts = state.counts()
    todo = ~done
    progress = Progress(meta.rows, done_before=int(done.sum()),
                        errors_before=counts["errors"] if not retry_errors else 0,
                        progress_path=job_dir.progress_path, tty=tty, quiet=quiet, task=job.task,
                        out=terminal.out, err=terminal.err)
    mode = "retry-errors" if retry_errors else ("resume" if counts["done"] else "run")
    job_dir.log(f"{mode}: {int(todo.sum()):,} rows to do of {meta.rows:,}")
    old_sigterm = _install_sigterm()
    state_name = "finished"
    run_info: dict[str, Any] = {}
    started = time.time()
    progress.start()
    try:
        if todo.any():
            launch_engine(job)  # (a resumed job's: before Ray's start)
            if ray_start is not None:  # begun beside the input's read: waited for where the rows need Ray
                progress.set_phase("starting Ray")
                progress.marks.update(ray_start.wait())
            execute(job, todo, done, progress)
    except KeyboardInterrupt:
        state_name = "stopped"
        job_dir.log("stopped by signal; committed rows are kept, run `llmbatch resume` to continue")
    except BaseException:
        state_name = "failed"
        raise
    finally:
        vllm_early.stop_all()  # an engine launched for the replica stops with the run
        snap = progress.stop(state_name)
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
        run_info = {"mode": mode, "started_at": started, "ended_at": time.time(), "state": state_name,
                    **snap["this_run"],
                    "marks": {"process_start": process_start_time(), "entered": entered, "ingest_s": ingest_s,
                              "first_row": progress.first_row_at,
                              "last_row": progress.last_row_at, **progress.marks}}
        meta.runs.append(run_info)
        job_dir.write_meta(meta)
    if state_name != "finished":
        return JobResult(job_dir.root, state_name, None, job_dir.errors_path, snap)
    try:
        stats = finish(job, run_info, progress)
    except KeyboardInterrupt:  # every row is committed; `resume` writes the output again
        run_info["state"] = "stopped"
        job_dir.write_meta(meta)
        snap = progress.mark("stopped")
        job_dir.log("stopped while writing the output; run `llmbatch resume` to write it")
        return JobResult(job_dir.root, "stopped", None, job_dir.errors_path, snap)
    job_dir.drop_journal()  # every answer it held is in a committed row now
    if report:
        stats["report"] = str(write_report(progress.timeline, job_dir.root / "report.png"))
        atomic_write_json(job_dir.stats_path, stats)
    job_dir.log(f"finished: {stats['rows_ok']:,} rows answered, {stats['rows_error']:,} errors")
    return JobResult(job_dir.root, "finished", stats["output"], job_dir.errors_path, stats)


def resolve_spec(job: JobSpec | dict | str | os.PathLike, overrides: list[str] | None) -> JobSpec:
    if isinstance(job, dict):  # a job file's sections (relative paths from the working directory)
        return load_job(data=job, overrides=overrides)
    if not isinstance(job, (JobSpec, str, os.PathLike)):
        raise ConfigError(f"a job is a JobSpec, a dict of a job file's sections, a job file or a job directory, "
                          f"not {type(job).__name__}")
    if isinstance(job, JobSpec):
        if overrides:
            data = json.loads(job.model_dump_json())
            return load_job(data=data, overrides=overrides)
        return job
    path = Path(job)
    if path.is_dir():
        # resume the directory given, wherever it is now (it may have been moved or restored)
        data = JobDir(path).meta().spec
        data["job_dir"] = str(path.resolve())
        check_no_redacted(data, path)
        return load_job(data=data, overrides=overrides)
    beside = job_dir_beside(path) if path.is_file() else None
    if beside is not None:  # an output given for its job
        raise ConfigError(f"{path} is a job's output, not a job file; its job directory is {beside}: "
                          f"`llmbatch resume {beside}`")
    return load_job(path, overrides)
