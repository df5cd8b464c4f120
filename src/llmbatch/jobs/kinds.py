"""The two kinds of job (:class:`~llmbatch.jobs.job.JobKind`), and the one place that tells
them apart (:func:`job_for`).

- :class:`RowsKind`: a table of rows (csv, jsonl, parquet, a Hugging Face dataset, images);
  the job's prompt templates (or its own functions) make the requests, and the output is a
  table (``jobs.output``).
- :class:`OpenAIBatchKind`: an OpenAI Batch API file; each line carries its own request (the
  built-in preprocess and postprocess of ``jobs.openai_batch``), every line is checked before
  any work, and the output is OpenAI's output and error files (``jobs.openai_output``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from llmbatch.io.csv_tables import csv_tables
from llmbatch.io.readers import DEFAULT_BATCH_ROWS, infer_format, read_rows
from llmbatch.jobs.fold import WRITTEN_COLUMNS
from llmbatch.jobs.job import Job, JobKind, Row
from llmbatch.jobs.meta import JobMeta
from llmbatch.jobs.openai_batch import (
    OpenAIBatchPostprocess,
    OpenAIBatchPreprocess,
    batch_options,
    check_batch_file,
    errors_path,
    served_names,
)
from llmbatch.jobs.openai_output import write_openai_output
from llmbatch.jobs.output import check_rename, write_output
from llmbatch.jobs.prompts import check_prompt_fields, job_preprocess
from llmbatch.jobs.spec import JobSpec, load_function
from llmbatch.jobs.store import JobDir, State
from llmbatch.jobs.tally import Tally
from llmbatch.openai.batch_file import FORMAT, read_openai_batch


class RowsKind(JobKind):
    """A job over a table of rows."""

    def read(self, job: Job, batch_rows: int | None = None) -> Iterator[list[Row]]:
        inp = job.spec.input
        return read_rows(inp.path, inp.format, inp.columns, inp.limit, batch_rows or DEFAULT_BATCH_ROWS)

    def read_tables(self, job: Job) -> Iterator[Any] | None:
        inp = job.spec.input
        if (inp.format or infer_format(inp.path)) != "csv":
            return None
        return csv_tables(inp.path, inp.columns, inp.limit)

    def check_columns(self, job: Job, columns: list[str]) -> None:
        check_prompt_fields(job.spec, columns)
        check_rename(job.spec, columns)

    def fold_columns(self, job: Job) -> list[str] | None:
        """The prompt's fields, where the request is the prompt templates' alone: no function of
        the user's on either side, no media, deterministic answers, and no input column that
        the processor would overwrite."""
        spec, prompt = job.spec, job.spec.prompt
        if prompt is None or spec.preprocess or spec.postprocess or prompt.image_column or prompt.audio_column:
            return None
        if not getattr(job.config, "dedup_requests", True):
            return None
        if job.task == "generate":
            params = spec.sampling_params or {}
            if not (params.get("temperature") == 0 or params.get("seed") is not None) or params.get("n", 1) != 1:
                return None
        columns = job.meta.columns if job.meta is not None else []
        if set(columns) & WRITTEN_COLUMNS:
            return None
        return prompt.fields(columns) or None

    def preprocess(self, job: Job) -> Callable[[Row], Row]:
        return job_preprocess(job.spec, job.task)

    def postprocess(self, job: Job) -> Callable[[Row], Row] | None:
        spec = job.spec
        return load_function(spec.postprocess, spec.python_path) if spec.postprocess else None

    def write_output(self, job: Job, state: State) -> tuple[str, Tally]:
        return write_output(job, state)


class OpenAIBatchKind(JobKind):
    """A job over an OpenAI Batch API file: a line is a request (a list prompt fans out)."""

    holds = "requests"
    input_flag = "--openai-batch (input.path)"

    def check_input(self, job: Job) -> None:
        check_batch_file(job.spec)  # with invalid_lines: fail, every bad line is listed before any work

    def read(self, job: Job, batch_rows: int | None = None) -> Iterator[list[Row]]:
        inp = job.spec.input
        return read_openai_batch(inp.path, batch_options(job.spec), inp.limit, batch_rows or DEFAULT_BATCH_ROWS)

    def preprocess(self, job: Job) -> Callable[[Row], Row]:
        return OpenAIBatchPreprocess(job.spec.sampling_params, served_names(job.spec))

    def postprocess(self, job: Job) -> Callable[[Row], Row] | None:
        return OpenAIBatchPostprocess()

    def identity(self, job: Job) -> dict[str, Any]:
        spec = job.spec  # (other jobs' fields stay as they were, so their job dirs resume)
        return {"input.invalid_lines": spec.input.invalid_lines, "input.endpoint": spec.input.endpoint,
                "model.served_model_name": spec.model.served_model_name}

    def outputs(self, job: Job) -> list[tuple[str, str]]:
        return [*super().outputs(job), (errors_path(job.spec), "--errors (output.errors_path)")]

    def write_output(self, job: Job, state: State) -> tuple[str, Tally]:
        if job.spec.output.resolved_format() != FORMAT:  # the answered rows as a table, asked for
            return write_output(job, state)
        path, totals, _ = write_openai_output(job.dir, job.spec, job.meta, state)
        return path, totals

    def stats(self, job: Job) -> dict[str, Any]:
        return {"openai_errors_file": errors_path(job.spec)}


def job_for(spec: JobSpec, meta: JobMeta | None = None, root: JobDir | None = None) -> Job:
    """The job ``spec`` describes (in its own job directory unless ``root`` is given)."""
    kind: JobKind = OpenAIBatchKind() if spec.input.format == FORMAT else RowsKind()
    return Job(root or JobDir(spec.resolved_job_dir()), spec, kind, meta)
