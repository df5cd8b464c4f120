"""A job, as one object: its directory, its spec, its ``job.json``, the processor config it
runs (resolved once), its task, and its kind.

A :class:`Job` is built once when a job is opened (``jobs.kinds.job_for``) and handed to
everything that works on it: running, the driver, the output, ``verify``. What differs between
a job over a table of rows and one over an OpenAI batch file (how the input is read and
checked, the built-in preprocess and postprocess, the fields that identify its answers, how
its output is written) is its :class:`JobKind`'s, so no module asks which kind it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from llmbatch.config import ProcessorConfig
from llmbatch.jobs.identity import numerics_fields, result_fields
from llmbatch.jobs.meta import JobMeta
from llmbatch.jobs.spec import JobSpec
from llmbatch.jobs.store import JobDir, State
from llmbatch.jobs.tally import Tally

Row = dict[str, Any]


class JobKind:
    """What a kind of job owns; :mod:`llmbatch.jobs.kinds` has the two there are."""

    #: What the input holds, in messages ("rows", "requests").
    holds = "rows"
    #: The flag (and job file field) that names the input, in messages.
    input_flag = "--input (input.path)"

    def check_input(self, job: Job) -> None:
        """Checks of the whole input before it is read (and before any work)."""

    def read(self, job: Job, batch_rows: int | None = None) -> Iterator[list[Row]]:
        """The input's records, in batches (a record that cannot be read carries its error)."""
        raise NotImplementedError

    def read_tables(self, job: Job) -> Iterator[Any] | None:
        """The input as Arrow tables where a fast reader can read it as :meth:`read` would
        (it may still give up: ``ingest``), else None."""
        return None

    def check_columns(self, job: Job, columns: list[str]) -> None:
        """Fail before any work where the job names a field the input does not have."""

    def fold_columns(self, job: Job) -> list[str] | None:
        """The input columns that decide a row's request, where rows equal in them can share
        one answer (``jobs.fold``); None: every row goes through the processor."""
        return None

    def preprocess(self, job: Job) -> Callable[[Row], Row]:
        """The processor's preprocess: row -> request."""
        raise NotImplementedError

    def postprocess(self, job: Job) -> Callable[[Row], Row] | None:
        """The processor's postprocess (None: the answered row as it is)."""
        return None

    def identity(self, job: Job) -> dict[str, Any]:
        """The kind's own fields that decide the answers (dotted keys, beside the job's)."""
        return {}

    def outputs(self, job: Job) -> list[tuple[str, str]]:
        """Files the job writes besides the job directory: (path, the flag that names it)."""
        return [(job.spec.output.path, "--output (output.path)")]

    def write_output(self, job: Job, state: State) -> tuple[str, Tally]:
        """Steps 1-3 of the output swap (``jobs.output``): the output path and the final counts."""
        raise NotImplementedError

    def stats(self, job: Job) -> dict[str, Any]:
        """What the kind adds to ``stats.json``."""
        return {}


@dataclass(eq=False)
class Job:
    """One job: built once when it is opened (``jobs.kinds.job_for``)."""

    dir: JobDir
    spec: JobSpec
    kind: JobKind
    meta: JobMeta | None = None

    @cached_property
    def config(self) -> ProcessorConfig:
        """The processor config the job runs, resolved once."""
        return self.spec.processor_config()

    @cached_property
    def task(self) -> str:
        """What the model does (the config's ``task_type``; an endpoint generates)."""
        return getattr(self.config, "task_type", None) or "generate"

    @cached_property
    def result_fields(self) -> dict[str, Any]:
        """The settings that decide the answers (``jobs.identity``), the kind's own included."""
        return {**result_fields(self.spec), **self.kind.identity(self)}

    @cached_property
    def numerics_fields(self) -> dict[str, Any]:
        return numerics_fields(self.spec)

    def preprocess(self) -> Callable[[Row], Row]:
        return self.kind.preprocess(self)

    def postprocess(self) -> Callable[[Row], Row] | None:
        return self.kind.postprocess(self)

    def log(self, message: str) -> None:
        self.dir.log(message)
