"""``llmbatch status``: where a job stands, from another terminal, while it runs or after.

Counts come from the committed parts (the truth, also after a crash); the start-up phase, rates
and ETA from the running driver's ``progress.json``, and after a run its ``stats.json`` (the
figures its live view ended on and its summary showed, over the same window).
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
    rate_keys = ("rows_per_s", "items_per_s", "input_tokens_per_s", "generated_tokens_per_s", "delivered_tokens_per_s")
    task = (meta.spec or {}).get("task") or "generate"
    if running and progress:
        # the running driver's figures (progress.json): the start-up phase, then the last 30 s
        fresh = time.time() - progress.get("updated_at", 0) < STALE_S
        info.update(
            task=progress.get("task", task),
            phase=progress.get("phase"),
            phase_s=progress.get("phase_s"),
            window=progress.get("window"),
            window_s=progress.get("window_s"),
            **{k: progress.get(k, 0.0) if fresh else 0.0 for k in rate_keys},
            eta_s=(counts["todo"] / progress["rows_per_s"]) if fresh and progress.get("rows_per_s") else None,
            replicas=progress.get("replicas", {}),
        )
    elif stats:
        # the last run's figures (stats.json): the same as its live view's last frame and summary
        info.update(task=stats.get("task", task), window=stats.get("window", "since start"),
                    window_s=stats.get("window_s", stats.get("wall_s")), startup_s=stats.get("startup_s"),
                    **{k: stats.get(k) for k in rate_keys}, output=stats.get("output"),
                    errors_file=stats.get("errors_file"))
    return info
