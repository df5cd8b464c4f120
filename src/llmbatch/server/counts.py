"""Live ``request_counts`` of a running batch, from its job directory.

A request (line) is completed when all its rows are answered, failed when one of them failed;
the committed parts are read once each (they never change), the row -> line map once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from llmbatch.jobs.store import JobDir, read_part_state


class LineCounter:
    """Completed and failed requests of one job, updated from its new parts."""

    def __init__(self, job_root: str | Path):
        self.job = JobDir(job_root)
        self.starts: np.ndarray | None = None
        self.done: np.ndarray | None = None
        self.error: np.ndarray | None = None
        self.read_parts: set[str] = set()

    def _load_lines(self) -> bool:
        if self.starts is not None:
            return True
        if not self.job.exists() or not self.job.meta().ingested:
            return False
        lines = np.concatenate([pq.read_table(p, columns=["line"]).column(0).to_numpy(zero_copy_only=False)
                                for p in self.job.input_files()] or [np.zeros(0, dtype=np.int64)])
        self.starts = np.flatnonzero(np.r_[True, lines[1:] != lines[:-1]]) if lines.size else np.zeros(0, dtype=np.int64)
        self.done = np.zeros(lines.size, dtype=bool)
        self.error = np.zeros(lines.size, dtype=bool)
        return True

    def update(self) -> tuple[int, int] | None:
        """(completed, failed) requests now; None before the job has read its input."""
        if not self._load_lines():
            return None
        for path in self.job.part_files():  # newest state of a row wins (parts are numbered)
            if path.name in self.read_parts:
                continue
            ids, errs = read_part_state(path)
            self.done[ids] = True
            self.error[ids] = errs
            self.read_parts.add(path.name)
        if self.done.size == 0:
            return 0, 0
        line_done = np.logical_and.reduceat(self.done, self.starts)
        line_error = np.logical_or.reduceat(self.done & self.error, self.starts)
        failed = int(line_error.sum())
        return int((line_done & ~line_error).sum()), failed
