"""``llmbatch status``: where a job stands, from another terminal, while it runs or after.

Counts come from the committed parts (the truth, also after a crash); rates and ETA from the
running driver's ``progress.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from llmbatch.jobs.store import JobDir
from llmbatch.jobs.tally import Tally
from llmbatch.rows import ERROR_COLUMN, ROW_ID

#: progress.json older than this while no driver holds the lock means the driver died.
STALE_S = 30.0


def job_status(root: str | Path) -> dict[str, Any]:
    job = JobDir(root)
    meta = job.meta()
    running = job.is_running()
    info: dict[str, Any] = {"job_dir": str(job.root), "rows_total": meta.rows}
    if not meta.ingested:
        info.update(state="reading input" if running else "not started", rows_total=0, rows_done=0, rows_ok=0,
                    rows_error=0, rows_todo=0, errors_by_type={})
        return info
    state = job.state(meta.rows)
    counts = state.counts()
    errors = Tally()
    for path in job.part_files():
        if ERROR_COLUMN not in pq.read_schema(path).names:
            continue
        t = pq.read_table(path, columns=[ROW_ID, ERROR_COLUMN])
        errors.add(t.filter(pa.array(state.latest[t.column(ROW_ID).to_numpy()] == job.part_index(path))))
    progress: dict[str, Any] = {}
    if job.progress_path.exists():
        try:
            progress = json.loads(job.progress_path.read_text())
        except ValueError:
            progress = {}
    stats: dict[str, Any] = {}
    if job.stats_path.exists():
        stats = json.loads(job.stats_path.read_text())
    parts = job.part_files()
    parts_upto = job.part_index(parts[-1]) if parts else -1
    output_current = (meta.finished or {}).get("parts_upto") == parts_upto and not meta.finalizing
    if running:
        label = "running"
    elif counts["todo"] == 0 and output_current:
        label = "finished"
    elif counts["todo"] == 0:
        label = "answered, output not written (resume to write it)"
    elif progress.get("state") == "stopped":
        label = "stopped (resume to continue)"
    else:
        # staged and left by a driver that is gone, even one killed before its first progress
        # file was written: never "not started"
        label = "interrupted (resume to continue)"
    info.update(
        state=label,
        rows_done=counts["done"],
        rows_ok=counts["ok"],
        rows_error=counts["errors"],
        rows_todo=counts["todo"],
        errors_by_type=dict(errors.error_types),
        parts=len(job.part_files()),
    )
    if running and progress:
        fresh = time.time() - progress.get("updated_at", 0) < STALE_S
        info.update(
            rows_per_s=progress.get("rows_per_s") if fresh else 0.0,
            input_tokens_per_s=progress.get("input_tokens_per_s", 0.0) if fresh else 0.0,
            generated_tokens_per_s=progress.get("generated_tokens_per_s", 0.0) if fresh else 0.0,
            delivered_tokens_per_s=progress.get("delivered_tokens_per_s", 0.0) if fresh else 0.0,
            eta_s=(counts["todo"] / progress["rows_per_s"]) if fresh and progress.get("rows_per_s") else None,
            replicas=progress.get("replicas", {}),
        )
    elif stats:
        info.update(rows_per_s=stats.get("rows_per_s"), generated_tokens_per_s=stats.get("generated_tokens_per_s"),
                    delivered_tokens_per_s=stats.get("delivered_tokens_per_s"),
                    input_tokens_per_s=stats.get("input_tokens_per_s"), output=stats.get("output"),
                    errors_file=stats.get("errors_file"))
    return info
