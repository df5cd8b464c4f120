"""Finishing a job: the output file, errors.jsonl and stats.json, made from the parts."""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from llmbatch.io.writers import OutputWriter, unify_schema
from llmbatch.jobs.spec import JobSpec
from llmbatch.jobs.store import JobDir, atomic_write_json, error_record
from llmbatch.progress import Progress
from llmbatch.rows import ENGINE_OUTPUT_COLUMNS, ERROR_COLUMN, PRIVATE_PREFIX, ROW_ID, STATS

ROW_ID_COLUMN = "row_id"


def _public(names: list[str]) -> list[str]:
    return [n for n in names if not n.startswith(PRIVATE_PREFIX) and n != ERROR_COLUMN]


def output_columns(job: JobDir, spec: JobSpec, meta: dict[str, Any]) -> tuple[list[str], list[pa.Schema]]:
    """The output's columns (after rename), in order, and the parts' schemas."""
    rename = spec.output.rename or {}
    schemas = []
    for path in job.part_files():
        schema = pq.read_schema(path)
        names = [rename.get(n, n) for n in schema.names]
        schemas.append(pa.schema([pa.field(n, schema.field(i).type) for i, n in enumerate(names)]))
    if spec.output.columns:
        return list(spec.output.columns), schemas
    seen: dict[str, None] = {}
    if not spec.input.id_column:
        seen[ROW_ID_COLUMN] = None
    inputs = [rename.get(c, c) for c in meta.get("columns", [])]
    engine = [rename.get(c, c) for c in ("generated_text",) + ENGINE_OUTPUT_COLUMNS]
    present = {n for s in schemas for n in s.names}
    if spec.postprocess:
        for s in schemas:
            seen.update(dict.fromkeys(_public(s.names)))
        return list(seen), schemas
    for name in inputs + engine:
        if name in present:
            seen[name] = None
    for s in schemas:
        seen.update(dict.fromkeys(_public(s.names)))
    return list(seen), schemas


def _success_columns(table: pa.Table, spec: JobSpec) -> pa.Table:
    rename = spec.output.rename or {}
    if ROW_ID in table.column_names and not spec.input.id_column:
        table = table.append_column(ROW_ID_COLUMN, table.column(ROW_ID))
    names = [rename.get(n, n) for n in table.column_names]
    return table.rename_columns(names)


def finish(job: JobDir, spec: JobSpec, meta: dict[str, Any], run_info: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Write the output and errors.jsonl from the parts, then stats.json; returns the stats."""
    state = job.state(meta["rows"])
    columns, schemas = output_columns(job, spec, meta)
    for_unify = [s for s in schemas]
    if not spec.input.id_column:
        for_unify.append(pa.schema([(ROW_ID_COLUMN, pa.int64())]))
    missing = [c for c in columns if not any(c in s.names for s in for_unify)]
    if missing and spec.output.columns:
        from llmbatch.errors import ConfigError

        known = sorted({n for s in for_unify for n in _public(s.names)})
        raise ConfigError(f"output.columns names {missing}, which the rows do not have; they have {known}")
    schema = unify_schema(for_unify, columns)
    writer = OutputWriter(spec.output.path, spec.output.resolved_format(), schema)
    input_columns = meta.get("columns", [])
    id_column = spec.input.id_column
    totals = collections.Counter()
    error_types: collections.Counter[str] = collections.Counter()
    replicas: collections.Counter[str] = collections.Counter()
    restarts: dict[str, int] = {}
    ready_at: list[float] = []
    tmp_errors = job.errors_path.with_name(".errors.jsonl.tmp")
    try:
        with open(tmp_errors, "w") as errors_fh:
            for table, newest in job.iter_final_rows(state):
                if ERROR_COLUMN in table.column_names:
                    err = pc.fill_null(table.column(ERROR_COLUMN), "")
                    is_err = np.asarray(pc.not_equal(err, "").to_numpy(zero_copy_only=False), dtype=bool)
                else:
                    is_err = np.zeros(table.num_rows, dtype=bool)
                ok_mask = newest & ~is_err
                err_mask = newest & is_err
                if ok_mask.any():
                    ok = table.filter(pa.array(ok_mask))
                    writer.write(_success_columns(ok, spec))
                    for name, key in (("num_input_tokens", "input_tokens"), ("num_generated_tokens", "output_tokens")):
                        if name in ok.column_names:
                            totals[key] += int(pc.sum(ok.column(name)).as_py() or 0)
                    if STATS in ok.column_names:
                        for s in ok.column(STATS).to_pylist():
                            if s:
                                totals["cached_tokens"] += int(s.get("cached_tokens") or 0)
                                totals["deduplicated_rows"] += int(bool(s.get("deduped")))
                                name = s.get("replica") or "?"
                                replicas[name] += 1
                                if (s.get("ready_at") or 0) >= run_info["started_at"]:
                                    ready_at.append(s["ready_at"])
                                restarts[name] = max(restarts.get(name, 0), int(s.get("restarts") or 0))
                if err_mask.any():
                    for row in table.filter(pa.array(err_mask)).to_pylist():
                        value = row.get(id_column) if id_column else row[ROW_ID]
                        record = error_record(row, value, input_columns)
                        error_types[f"{record['stage']}: {record['error_type']}"] += 1
                        errors_fh.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        output_path = writer.close()
    except BaseException:
        writer.abort()
        raise
    tmp_errors.replace(job.errors_path)
    counts = state.counts()
    runs = meta.get("runs", [])
    wall = run_info["ended_at"] - run_info["started_at"]
    this_rows = run_info.get("ok", 0) + run_info.get("errors", 0)
    snap = progress.snapshot()
    # steady state: from the moment this run's first engine replica was ready
    steady = (run_info["ended_at"] - min(ready_at)) if ready_at else None
    stats = {
        "job_dir": str(job.root),
        "output": output_path,
        "errors_file": str(job.errors_path),
        "rows": counts["rows"],
        "rows_ok": counts["ok"],
        "rows_error": counts["errors"],
        "input_tokens": totals["input_tokens"],
        "output_tokens": totals["output_tokens"],
        "cached_prompt_tokens": totals["cached_tokens"],
        "prefix_cache_hit_rate": round(totals["cached_tokens"] / totals["input_tokens"], 4) if totals["input_tokens"] else 0.0,
        "deduplicated_rows": totals["deduplicated_rows"],
        "dedup_ratio": round(totals["deduplicated_rows"] / counts["ok"], 4) if counts["ok"] else 0.0,
        "errors_by_type": dict(error_types),
        "rows_by_replica": dict(replicas),
        "engine_restarts": sum(restarts.values()),
        "config_hash": meta.get("config_hash"),
        "wall_s": round(wall, 2),
        "rows_this_run": this_rows,
        "rows_per_s": round(this_rows / wall, 3) if wall > 0 else 0.0,
        "output_tokens_per_s": round(run_info.get("output_tokens", 0) / wall, 2) if wall > 0 else 0.0,
        "input_tokens_per_s": round(run_info.get("input_tokens", 0) / wall, 2) if wall > 0 else 0.0,
        "steady_s": round(steady, 2) if steady else None,
        "steady_rows_per_s": round(this_rows / steady, 3) if steady else None,
        "steady_output_tokens_per_s": round(run_info.get("output_tokens", 0) / steady, 2) if steady else None,
        "runs": runs,
        "finished_at": time.time(),
        "last_progress": snap,
    }
    atomic_write_json(job.stats_path, stats)
    return stats
