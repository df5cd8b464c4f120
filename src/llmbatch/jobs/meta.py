"""``job.json``: what a job is and where it stands, typed.

The job directory's store reads and writes it (:meth:`~llmbatch.jobs.store.JobDir.meta`);
every other module gets a :class:`JobMeta`, never a loose dict.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

#: The layout of a job directory; a directory of another version is refused (``--force``).
FORMAT_VERSION = 2  # 2: input as Arrow columns, never pickles (1 held pickled rows)


@dataclass
class JobMeta:
    """The contents of ``job.json``."""

    spec: dict[str, Any]                          # the job as written (secrets redacted, ${VAR} kept)
    result_fields: dict[str, Any]                 # settings that decide the answers (redacted)
    numerics_fields: dict[str, Any]               # settings that may change a near-tie (redacted)
    config_hash: str
    version: int = FORMAT_VERSION
    created_at: float = field(default_factory=time.time)
    ingested: bool = False                        # the input is read into input/ with row ids
    rows: int = 0
    columns: list[str] = field(default_factory=list)
    column_types: dict[str, str] = field(default_factory=dict)   # CSV: output type per column
    ingest_rows: int = 0                          # rows per file in input/
    input_fingerprint: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    config_history: list[dict[str, Any]] = field(default_factory=list)
    finalizing: dict[str, Any] | None = None      # the output swap in progress (see jobs.output)
    finished: dict[str, Any] | None = None        # the parts the current output was made from

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobMeta":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
