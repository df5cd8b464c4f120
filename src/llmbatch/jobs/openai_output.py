"""Writing an openai-batch job's output: OpenAI's output file and error file, from the parts.

The same swap as every job's output (:mod:`llmbatch.jobs.output`): the output file, the
OpenAI error file and ``errors.jsonl`` are written beside their final names, fsynced, and
renamed into place after ``job.json`` records ``finalizing``. Every line of the input appears
exactly once across the two files: answered lines in the output, failed ones (and, for a batch
stopped before the end, the lines never run: ``missing``) in the error file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from llmbatch.codec import table_to_rows
from llmbatch.io.files import fsync_dir, temporary_name
from llmbatch.jobs.ingest import input_rows
from llmbatch.jobs.meta import JobMeta
from llmbatch.jobs.openai_batch import errors_path, served_names
from llmbatch.jobs.spec import JobSpec
from llmbatch.jobs.store import JobDir, State, error_record
from llmbatch.jobs.tally import Tally
from llmbatch.openai.responses import error_code, error_line, output_line
from llmbatch.redact import redact_text
from llmbatch.rows import ERROR_COLUMN, ROW_ID


@dataclass
class LineCounts:
    """Requests (lines) by outcome, as an OpenAI batch's ``request_counts`` counts them."""

    completed: int = 0
    failed: int = 0
    not_run: int = 0


def job_key(meta: JobMeta) -> str:
    """What makes a job's output ids its own (stable across rewrites of its output)."""
    return f"{meta.config_hash}:{meta.created_at!r}"


class _Files:
    """The three files being written, each beside its final name."""

    def __init__(self, job: JobDir, spec: JobSpec):
        self.final = [Path(spec.output.path), Path(errors_path(spec)), job.errors_path]
        for path in self.final[:2]:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = [temporary_name(p) for p in self.final]
        self.fh = [open(p, "w", encoding="utf-8") for p in self.tmp]

    def write(self, which: int, record: dict[str, Any]) -> None:
        self.fh[which].write(json.dumps(record, ensure_ascii=False, default=str) + "\n")

    def finish(self) -> None:
        for fh in self.fh:
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()

    def abort(self) -> None:
        for fh, tmp in zip(self.fh, self.tmp):
            fh.close()
            tmp.unlink(missing_ok=True)

    def commit(self) -> None:
        for tmp, final in zip(self.tmp, self.final):
            os.replace(tmp, final)
        for folder in {p.parent for p in self.final}:
            fsync_dir(folder)


def _rows(job: JobDir, state: State) -> Iterator[tuple[dict[str, Any], pa.Table]]:
    for table, newest in job.iter_final_rows(state):
        table = table.filter(pa.array(newest))
        for row in table_to_rows(table):
            yield row, table


def write_openai_output(job: JobDir, spec: JobSpec, meta: JobMeta, state: State,
                        missing: tuple[str, str] | None = None) -> tuple[str, Tally, LineCounts]:
    """Write the output file and error file (see module docstring); ``missing`` = (code,
    message) for lines never run (a cancelled or expired batch). Returns the output path, the
    final rows' counts and the lines by outcome."""
    key = job_key(meta)
    model = served_names(spec)[0]
    files = _Files(job, spec)
    totals = Tally()
    counts = LineCounts()
    groups: dict[Any, dict[int, dict[str, Any]]] = {}

    def emit(rows: list[dict[str, Any]]) -> None:
        failed = next((r for r in rows if r.get(ERROR_COLUMN)), None)
        if failed is None:
            files.write(0, output_line(rows, model, key))
            counts.completed += 1
            return
        code, message = error_code(failed[ERROR_COLUMN])
        files.write(1, error_line(key, failed.get("custom_id"), failed.get("line"), code, redact_text(message)))
        record = error_record(failed, failed.get("custom_id"), meta.columns)
        record["message"] = redact_text(record["message"])
        files.write(2, record)
        counts.failed += 1

    try:
        seen_tables: set[int] = set()
        for row, table in _rows(job, state):
            if id(table) not in seen_tables:
                seen_tables.add(id(table))
                totals.add(table)
            subs = int(row.get("subs") or 1)
            if subs == 1:
                emit([row])
                continue
            group = groups.setdefault(row.get("line"), {})
            group[int(row.get("sub") or 0)] = row
            if len(group) == subs:
                emit([group[i] for i in range(subs)])
                del groups[row.get("line")]
        if missing is not None:
            missed: set[Any] = set()
            for row in _not_done(job, state):
                line = row.get("line")
                if line not in missed:
                    missed.add(line)
                    groups.pop(line, None)
                    files.write(1, error_line(key, row.get("custom_id"), line, *missing))
                    counts.not_run += 1
        for line, group in groups.items():  # a fanned-out request some of whose rows never ran
            first = next(iter(group.values()))
            files.write(1, error_line(key, first.get("custom_id"), line, *(missing or ("server_error", "not run"))))
            counts.not_run += 1
        files.finish()
    except BaseException:
        files.abort()
        raise
    meta.finalizing = {"parts_upto": _parts_upto(job), "at": time.time()}
    meta.finished = None
    job.write_meta(meta)
    files.commit()
    return spec.output.path, totals, counts


def _not_done(job: JobDir, state: State) -> Iterator[dict[str, Any]]:
    """The staged rows of the lines not committed (in line order)."""
    ids = np.flatnonzero(~state.done)
    if ids.size == 0:
        return
    for path in job.input_files():
        for row in input_rows(path, ids):
            if row.get(ROW_ID) is not None:
                yield row


def _parts_upto(job: JobDir) -> int:
    parts = job.part_files()
    return job.part_index(parts[-1]) if parts else -1
