"""The job directory: its metadata, lock, input, committed parts and where every row stands.

```
JOBDIR/job.json         resolved job, config hash, input fingerprint, row count
JOBDIR/input/*.parquet  the input, read once (jobs.ingest): row id + the row's columns (typed
                        Arrow, or JSON text where the values have no one type; never a pickle)
JOBDIR/parts/*.parquet  committed answers and error rows, immutable, numbered
JOBDIR/errors.jsonl     one line per failed row (id, stage, error type, message, input)
JOBDIR/stats.json       totals when a run ends; progress.json while it runs; log.txt
```

Exactly once: a part is written to a temporary file, fsynced and renamed into place (the
rename is the commit). A row id is committed at most once per run (the driver drops repeats),
and when parts disagree (``retry-errors`` answered a row that had failed) the newest part wins.
The output file is made from the parts, so every input id appears exactly once across the
output and ``errors.jsonl``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from llmbatch.codec import has_text
from llmbatch.errors import JobError
from llmbatch.io.files import atomic_write_json, atomic_write_parquet, fsync_dir
from llmbatch.io.readers import open_input
from llmbatch.jobs.lock import lock_is_held, open_no_follow, take_lock
from llmbatch.jobs.meta import FORMAT_VERSION, JobMeta
from llmbatch.redact import redact_text
from llmbatch.rows import ANSWER, ERROR_COLUMN, ROW_ID, parse_error
from llmbatch.stages.answers import read_record

LOCK_NAME = "lock"
ERROR_ROW_CHARS = 2_000


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open_input(path) as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def input_files(path: str) -> list[str]:
    """The files of an input: a local folder's files (hidden ones left out), else the path."""
    if "://" not in path and os.path.isdir(path):
        return sorted(str(p) for p in Path(path).rglob("*") if p.is_file() and not p.name.startswith("."))
    return [path]


def input_fingerprint(path: str) -> dict[str, Any]:
    """What identifies the input's content: per file, size, mtime and sha256."""
    out = []
    for f in input_files(path):
        # a name, never a URL's credentials or signed query
        name = os.path.relpath(f, path) if f != path else os.path.basename(urlsplit(f).path if "://" in f else f)
        entry: dict[str, Any] = {"file": name}
        if "://" not in f:
            st = os.stat(f)
            entry.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
        entry["sha256"] = file_sha256(f)
        out.append(entry)
    return {"files": out}


def same_input(recorded: dict[str, Any], path: str) -> tuple[bool, str]:
    """Whether ``path`` still has the recorded content (cheap when size and mtime match)."""
    files = recorded.get("files", [])
    if "://" not in path and len(files) == 1 and not os.path.isdir(path):
        if not os.path.exists(path):
            return False, f"the input {path} no longer exists"
        st = os.stat(path)
        if st.st_size == files[0].get("size") and st.st_mtime_ns == files[0].get("mtime_ns"):
            return True, ""
    current = input_fingerprint(path)
    if [f["sha256"] for f in current["files"]] == [f["sha256"] for f in files]:
        return True, ""
    return False, f"the input {path} changed since the job started (its content hash differs)"


@dataclass
class State:
    """Where every row stands: the newest part that has it, and whether that is an error."""

    latest: np.ndarray    # int32 per row id: newest part index holding it, -1 when not committed
    error: np.ndarray     # bool per row id: newest state is an error row

    @property
    def done(self) -> np.ndarray:
        return self.latest >= 0

    def counts(self) -> dict[str, int]:
        done = int(self.done.sum())
        errors = int((self.done & self.error).sum())
        return {"rows": int(self.latest.size), "done": done, "ok": done - errors, "errors": errors,
                "todo": int(self.latest.size) - done}


class JobDir:
    """A job directory on local disk (see module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.meta_path = self.root / "job.json"
        self.input_dir = self.root / "input"
        self.parts_dir = self.root / "parts"
        self.errors_path = self.root / "errors.jsonl"
        self.stats_path = self.root / "stats.json"
        self.progress_path = self.root / "progress.json"
        self.log_path = self.root / "log.txt"
        #: the engine's answers as they are made, before their rows are committed
        #: (stages/answers.py); dropped when the job finishes
        self.journal_dir = self.root / "answers"
        self._lock_fh = None
        self._next_part: int | None = None

    def drop_journal(self) -> None:
        """Remove the answer journal (the job finished: its answers are in committed rows)."""
        shutil.rmtree(self.journal_dir, ignore_errors=True)

    # -- meta --------------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.meta_path.exists()

    def meta(self) -> JobMeta:
        if not self.exists():
            beside = job_dir_beside(self.root)  # an output's path given for its job's
            hint = (f"; the job of that output is {beside}" if beside is not None else
                    "; give the folder `llmbatch run` printed as 'job dir'")
            raise JobError(f"{self.root} is not a job directory (no job.json){hint}")
        data = json.loads(self.meta_path.read_text())
        if data.get("version") != FORMAT_VERSION:
            raise JobError(f"{self.root} was made by another llmbatch format (v{data.get('version')}); "
                           "use --force to start over")
        return JobMeta.from_dict(data)

    def write_meta(self, meta: JobMeta) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.meta_path, meta.to_dict())

    def log(self, message: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open_no_follow(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "a") as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {redact_text(message)}\n")

    def reset(self) -> None:
        """Delete everything the job left (``--force``), keeping the lock its caller holds."""
        for entry in self.root.iterdir():
            if entry.name == LOCK_NAME:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    # -- lock --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the job's lock (one driver per job dir)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fh = open_no_follow(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, "r+")
        try:
            take_lock(fh)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip()
            fh.close()
            raise JobError(f"job {self.root} is running in another process ({holder or 'pid unknown'}); "
                           "wait for it, or stop it first") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {os.uname().nodename}")
        fh.flush()
        self._lock_fh = fh
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()
            self._lock_fh = None

    def is_running(self) -> bool:
        """Whether a driver holds this job's lock right now."""
        return lock_is_held(self.root / LOCK_NAME)

    # -- input -----------------------------------------------------------------------------

    def input_files(self) -> list[Path]:
        return sorted(self.input_dir.glob("part-*.parquet"))

    # -- parts -------------------------------------------------------------------------------

    def part_files(self) -> list[Path]:
        return sorted(self.parts_dir.glob("part-*.parquet"))

    @staticmethod
    def part_index(path: Path) -> int:
        return int(path.stem.split("-")[1])

    def clean_temporaries(self) -> None:
        """Remove what a crash left half written (hidden ``.NAME.tmp`` files and folders in the
        job directory and its parts); called under the lock, before anything is written."""
        for folder in (self.root, self.parts_dir):
            if not folder.is_dir():
                continue
            for tmp in folder.glob(".*.tmp"):
                if tmp.is_dir() and not tmp.is_symlink():
                    shutil.rmtree(tmp)
                else:
                    tmp.unlink(missing_ok=True)

    def commit(self, table: pa.Table) -> Path:
        """Write one part atomically; returns its path."""
        return self.commit_parts([table])[0]

    def commit_parts(self, tables: list[pa.Table]) -> list[Path]:
        """Write parts atomically, in order, the folder fsynced once after the last (each part
        is whole or absent either way; a crash before that fsync may keep only the first ones,
        which a resume counts as it finds them); returns their paths."""
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        if self._next_part is None:
            files = self.part_files()
            self._next_part = self.part_index(files[-1]) + 1 if files else 0
        paths = []
        for table in tables:
            # the index is taken before the write: a Ctrl-C (KeyboardInterrupt) that lands after
            # the part is in place but before the count moved on would make the stop's own last
            # commit find its name taken (a gap in the numbers is harmless: parts are ordered, not
            # counted)
            path = self.parts_dir / f"part-{self._next_part:06d}.parquet"
            self._next_part += 1
            try:
                atomic_write_parquet(table, path, replace=False, sync_dir=False)
            except FileExistsError:
                raise JobError(f"{path} was committed by another driver while this one held the job's lock (does "
                               "this filesystem honour flock? NFS and some FUSE mounts do not); nothing was "
                               "replaced: stop the other driver and resume") from None
            paths.append(path)
        if paths:
            fsync_dir(self.parts_dir)
        return paths

    def state(self, rows: int | None = None) -> State:
        """Scan the parts (ids and error flags only) into a :class:`State`."""
        rows = self.meta().rows if rows is None else rows
        latest = np.full(rows, -1, dtype=np.int32)
        error = np.zeros(rows, dtype=bool)
        for path, (ids, errs) in read_ahead(self.part_files(), read_part_state):
            latest[ids] = self.part_index(path)
            error[ids] = errs
        return State(latest, error)

    # -- output ------------------------------------------------------------------------------

    def iter_final_rows(self, state: State, columns: Collection[str] | None = None
                        ) -> Iterator[tuple[pa.Table, np.ndarray]]:
        """Each part with the mask of its rows that are the newest state of their id; with
        ``columns``, only those of them a part has (and the row id): a part also holds what the
        output leaves out, such as each row's whole conversation and prompt."""
        read = pq.read_table if columns is None else functools.partial(read_part_columns, columns=columns)
        for path, table in read_ahead(self.part_files(), read):
            ids = table.column(ROW_ID).to_numpy()
            mask = state.latest[ids] == self.part_index(path)
            if mask.any():
                yield table, mask


T = TypeVar("T")

#: Parts read at once, ahead of the one in use (a big job has thousands of small parts; each read
#: waits on the disk and pyarrow, with the GIL released)
READ_AHEAD = 8


def read_ahead(paths: list[Path], read: Callable[[Path], T]) -> Iterator[tuple[Path, T]]:
    """``(path, read(path))`` in the order of ``paths``, up to :data:`READ_AHEAD` reads running
    ahead on threads (memory: that many parts at most)."""
    if len(paths) < 2:
        yield from ((path, read(path)) for path in paths)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(READ_AHEAD, os.cpu_count() or 1)) as pool:
        waiting: collections.deque = collections.deque()
        for path in paths:
            waiting.append((path, pool.submit(read, path)))
            if len(waiting) > READ_AHEAD:
                done, future = waiting.popleft()
                yield done, future.result()
        while waiting:
            done, future = waiting.popleft()
            yield done, future.result()


def read_part_columns(path: Path, columns: Collection[str]) -> pa.Table:
    """A committed part's columns among ``columns`` (and its row ids), in the part's order."""
    with pq.ParquetFile(path) as part:
        return part.read(columns=[n for n in part.schema_arrow.names if n in columns or n == ROW_ID])


def read_part_state(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(row ids, is-error flags) of a committed part; a part without an error column (written
    by an older llmbatch with postprocess and continue_on_error off) holds answered rows."""
    names = pq.read_schema(path).names
    columns = [ROW_ID, ERROR_COLUMN] if ERROR_COLUMN in names else [ROW_ID]
    t = pq.read_table(path, columns=columns)
    ids = t.column(ROW_ID).to_numpy()
    if ERROR_COLUMN not in names:
        return ids, np.zeros(len(ids), dtype=bool)
    return ids, has_text(t.column(ERROR_COLUMN))


#: bytes of answer records a resumed job reads back (about 1 KiB per distinct short answer)
KNOWN_ANSWER_BYTES = 512 << 20


def job_dir_beside(output: Path) -> Path | None:
    """The job directory of the output at ``output`` (its default place, ``<output>.job``), where
    there is one: a path given for a job's that names its output."""
    beside = output.with_name(output.name + ".job")
    return beside if JobDir(beside).exists() else None


def committed_answers(job: "JobDir", tag: str, limit_bytes: int = KNOWN_ANSWER_BYTES) -> dict[bytes, dict[str, Any]]:
    """The answers the job recorded under ``tag`` (stages/answers.py), by request digest: those
    its committed rows carry (rows that are errors now, a retried row's older state included,
    give none), and those its answer journal holds (made by a run that ended before their rows
    were committed; a line cut short by a kill is skipped)."""
    answers: dict[bytes, dict[str, Any]] = {}
    size = 0

    def records():
        for path in sorted(job.journal_dir.glob("*")) if job.journal_dir.is_dir() else ():
            with open(path, encoding="utf-8", errors="replace") as fh:
                yield from fh
        for _, texts in read_ahead(job.part_files(), _answer_records):
            yield from texts

    for text in records():
        size += len(text)
        if size > limit_bytes:
            return answers
        found = read_record(text, tag)
        if found is not None:
            answers[found[0]] = found[1]
    return answers


def _answer_records(path: Path) -> list[str]:
    """The answer records of a part's rows that are not errors (most rows of a repetitive job
    carry none: a copy's is its original's)."""
    names = pq.read_schema(path).names
    if ANSWER not in names:
        return []
    columns = [ANSWER, ERROR_COLUMN] if ERROR_COLUMN in names else [ANSWER]
    table = pq.read_table(path, columns=columns)
    keep = has_text(table.column(ANSWER))
    if ERROR_COLUMN in names:
        keep &= ~has_text(table.column(ERROR_COLUMN))
    return table.column(ANSWER).filter(pa.array(keep)).to_pylist()


def error_record(row: dict[str, Any], id_value: Any, input_columns: list[str]) -> dict[str, Any]:
    """One line of errors.jsonl."""
    stage, etype, message = parse_error(row.get(ERROR_COLUMN) or "")
    shown: dict[str, Any] = {}
    budget = ERROR_ROW_CHARS * 5
    for col in input_columns:
        if col not in row:
            continue
        value = row[col]
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > ERROR_ROW_CHARS:
            value = text[:ERROR_ROW_CHARS] + f"...[{len(text) - ERROR_ROW_CHARS} more chars]"
        budget -= min(len(text), ERROR_ROW_CHARS)
        if budget < 0:
            shown["..."] = "more columns left out"
            break
        shown[col] = value
    return {"id": id_value, "stage": stage, "error_type": etype, "message": message, "row": shown}

