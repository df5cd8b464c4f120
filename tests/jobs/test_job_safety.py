"""A job directory survives concurrent drivers, moves and crashes at any step of finishing.

These run without an engine: each job is staged for real and its answers are committed as
parts the way the driver commits them, so that ``run_job`` only has to finish (or refuse).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from llmbatch.codec import rows_to_table
from llmbatch.errors import JobError
from llmbatch.jobs.identity import result_fields
from llmbatch.jobs.ingest import input_rows
from llmbatch.jobs.kinds import job_for
from llmbatch.jobs.output import CRASH_ENV
from llmbatch.jobs.run import open_job, read_input, run_job
from llmbatch.jobs.spec import load_job
from llmbatch.jobs.status import job_status
from llmbatch.jobs.store import JobDir
from llmbatch.rows import ERROR_COLUMN, ROW_ID, STATS

ROWS = 40
JOB = """
input: {path: data.csv, id_column: Index}
model: {source: smollm2-135m-instruct, engine_kwargs: {max_model_len: 256}}
prompt: {user: "Which industry is {Company} in?"}
sampling_params: {temperature: 0, max_tokens: 4}
output: {path: out/result.jsonl}
"""


def write_job(tmp_path, body: str = JOB, rows: int = ROWS):
    lines = ["Index,Company"] + [f"{i + 1},Company {i}" for i in range(rows)]
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def answer(job: JobDir, ids, error_ids=(), **columns):
    """Commit answers for ``ids`` as the driver would (error rows for ``error_ids``; ``columns``:
    more columns, the same value in every row)."""
    rows = []
    for path in job.input_files():
        for row in input_rows(path):
            if row[ROW_ID] in ids:
                failed = row[ROW_ID] in error_ids
                row.update(generated_text="" if failed else f"answer {row[ROW_ID]}",
                           num_input_tokens=7, num_generated_tokens=0 if failed else 2,
                           finish_reason="error" if failed else "stop",
                           **{ERROR_COLUMN: "engine: ValueError: rejected" if failed else "",
                              STATS: {"replica": "r1", "deduped": False}}, **columns)
                rows.append(row)
    job.commit(rows_to_table(rows))


def staged_job(tmp_path, **answer_kwargs):
    spec = load_job(write_job(tmp_path))
    job = JobDir(spec.resolved_job_dir())
    opened = job_for(spec)
    open_job(opened)
    read_input(opened)
    answer(job, set(range(ROWS)), **answer_kwargs)
    return spec, job


def ids_in_output_and_errors(spec, job):
    out = [json.loads(line)["Index"] for line in open(spec.output.path)]
    errs = [json.loads(line)["id"] for line in open(job.errors_path)]
    return out, errs


def test_lock_is_taken_before_anything_changes(tmp_path):
    spec, job = staged_job(tmp_path)
    with job.locked():  # another driver runs this job
        before = sorted(p.name for p in job.root.rglob("*"))
        meta_before = job.meta_path.read_text()
        with pytest.raises(JobError, match="running in another process"):
            run_job(spec, force=True, quiet=True)
        with pytest.raises(JobError, match="running in another process"):
            run_job(job.root, overrides=["model.engine_kwargs.max_model_len=512"], retry_errors=True, quiet=True)
    assert sorted(p.name for p in job.root.rglob("*")) == before  # --force deleted nothing
    assert job.meta_path.read_text() == meta_before                # retry-errors --set rewrote nothing


def test_force_keeps_the_lock_file_it_holds(tmp_path):
    spec, job = staged_job(tmp_path)
    with job.locked():
        meta = open_job(job_for(spec), force=True)
        assert not meta.ingested and (job.root / "lock").exists() and not job.parts_dir.exists()


def test_resume_continues_the_directory_it_is_given(tmp_path):
    spec, job = staged_job(tmp_path)
    moved = tmp_path / "elsewhere" / "restored.job"
    moved.parent.mkdir()
    shutil.move(str(job.root), moved)
    result = run_job(moved, quiet=True)
    assert result.ok and result.job_dir == moved.resolve()
    assert not job.root.exists()  # no new job started at the spec's own <output>.job
    out, errs = ids_in_output_and_errors(spec, JobDir(moved))
    assert sorted(out) == list(range(1, ROWS + 1)) and errs == []


def test_postprocess_job_parts_without_error_column_are_read(tmp_path):
    # parts written with postprocess and continue_on_error off had no error column
    spec, job = staged_job(tmp_path)
    for path in job.part_files():
        table = pq.read_table(path)
        pq.write_table(table.drop_columns([ERROR_COLUMN]), path)
    assert job.state().counts()["ok"] == ROWS
    assert job_status(job.root)["rows_ok"] == ROWS
    assert run_job(spec, quiet=True).ok


def test_the_output_reads_only_the_parts_columns_it_writes(tmp_path, monkeypatch):
    # a part also holds each row's conversation and prompt (a kilobyte a row in a big job), which
    # the output leaves out: reading them for every part was most of a 2,000,000-row job's output
    from llmbatch.jobs import store

    body = JOB.replace("output: {path: out/result.jsonl}",
                       "output: {path: out/result.jsonl, rename: {generated_text: industry}}")
    spec = load_job(write_job(tmp_path, body))
    job = JobDir(spec.resolved_job_dir())
    opened = job_for(spec)
    open_job(opened)
    read_input(opened)
    answer(job, set(range(ROWS)), error_ids={3}, prompt="a long prompt " * 20,
           messages=json.dumps([{"role": "user", "content": "x"}]), batch_uuid="b")
    read = []
    real = store.read_part_columns
    monkeypatch.setattr(store, "read_part_columns", lambda path, columns: read.append(real(path, columns)) or read[-1])
    assert run_job(spec, quiet=True).ok
    assert read and all(not {"prompt", "messages", "batch_uuid"} & set(t.column_names) for t in read), \
        [t.column_names for t in read]
    lines = [json.loads(line) for line in open(spec.output.path)]
    assert len(lines) == ROWS - 1 and lines[0]["industry"] == "answer 0" and lines[0]["Company"] == "Company 0"
    assert {"Index", "Company", "industry", "num_generated_tokens"} <= set(lines[0]) and "prompt" not in lines[0]
    [error] = [json.loads(line) for line in open(job.errors_path)]
    assert error["id"] == 4 and error["row"] == {"Index": "4", "Company": "Company 3"}, error
    assert job_status(job.root)["rows_ok"] == ROWS - 1
    stats = json.loads(job.stats_path.read_text())  # the counts read their columns too
    assert stats["rows_by_replica"] == {"r1": ROWS - 1} and stats["input_tokens"] == 7 * (ROWS - 1), stats


@pytest.mark.parametrize("step", ["written", "finalizing", "output-swapped", "errors-swapped"])
def test_a_crash_at_any_step_of_finishing_is_repaired_by_resume(tmp_path, step):
    # a first finish: rows 3 and 5 failed
    spec, job = staged_job(tmp_path, error_ids={3, 5})
    assert run_job(spec, quiet=True).ok
    out, errs = ids_in_output_and_errors(spec, job)
    assert sorted(errs) == [4, 6] and len(out) == ROWS - 2
    # retry-errors answers them (a new part), then the process is killed while finishing
    answer(job, {3, 5})
    env = {**os.environ, CRASH_ENV: step}
    code = "import sys; from llmbatch.jobs.run import run_job; run_job(sys.argv[1], quiet=True)"
    proc = subprocess.run([sys.executable, "-c", code, str(job.root)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    # status never calls a stale output finished
    assert job_status(job.root)["state"] != "finished"
    result = run_job(job.root, quiet=True)
    assert result.ok and job_status(job.root)["state"] == "finished"
    out, errs = ids_in_output_and_errors(spec, job)
    assert sorted(out + errs) == list(range(1, ROWS + 1)) and errs == []


def test_finished_outputs_and_staged_input_are_fsynced_before_they_are_relied_on(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        try:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    spec, job = staged_job(tmp_path, error_ids={2})
    staged = [str(p) for p in job.input_files()]
    assert all(any(s.endswith(os.path.basename(p)) for s in synced) for p in staged)
    synced.clear()
    run_job(spec, quiet=True)
    assert any(s.endswith(".errors.jsonl.tmp") for s in synced)
    assert any(s.endswith(".result.jsonl.tmp") for s in synced)


def test_function_and_model_identity_cover_what_changes_answers(tmp_path):
    (tmp_path / "helpers.py").write_text("PREFIX = 'Q: '\n")
    (tmp_path / "prep.py").write_text(textwrap.dedent("""
        import helpers
        STYLE = 'short'
        def pre(row):
            return {"prompt": helpers.PREFIX + row["Company"] + STYLE}
    """))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"0" * 100)
    body = JOB.replace('prompt: {user: "Which industry is {Company} in?"}', "preprocess: prep:pre").replace(
        "source: smollm2-135m-instruct", "source: ./model")
    spec = load_job(write_job(tmp_path, body))
    first = result_fields(spec)
    (tmp_path / "helpers.py").write_text("PREFIX = 'Question: '\n")  # a helper module changes
    for name in ("helpers", "prep"):
        sys.modules.pop(name, None)
    second = result_fields(load_job(tmp_path / "job.yaml"))
    assert first != second and any(k.startswith("preprocess.sources.helpers") for k in second)
    (model / "model.safetensors").write_bytes(b"0" * 101)  # other weights
    for name in ("helpers", "prep"):
        sys.modules.pop(name, None)
    third = result_fields(load_job(tmp_path / "job.yaml"))
    assert third["model.fingerprint.files.model.safetensors"] == 101 and third != second
    assert str(tmp_path) not in sys.path  # the job's folder is not left on sys.path


def test_resume_never_reruns_error_rows_and_retry_errors_runs_only_them(tmp_path, monkeypatch):
    # the README's promise: `resume` counts an error row as done (it stays in errors.jsonl);
    # only `retry-errors` asks again, and only for those rows
    import llmbatch.jobs.run as run_module

    spec, job = staged_job(tmp_path, error_ids={3, 7})
    result = run_job(job.root, quiet=True)
    assert result.ok
    out, errs = ids_in_output_and_errors(spec, job)
    assert sorted(errs) == [4, 8] and sorted(out + errs) == list(range(1, ROWS + 1))
    assert "resume: 0 rows to do" in (job.root / "log.txt").read_text()

    asked = []

    def execute(job, todo, done, progress):
        asked.extend(int(i) for i in todo.nonzero()[0])
        raise KeyboardInterrupt  # stop there: no engine in this test

    monkeypatch.setattr(run_module, "execute", execute)
    assert run_job(job.root, quiet=True).state == "finished"  # a second resume: nothing to run
    assert asked == []
    assert run_job(job.root, retry_errors=True, quiet=True).state == "stopped"
    assert asked == [3, 7]


def test_an_engine_launched_for_a_job_stops_however_the_run_ends(tmp_path, monkeypatch):
    # the driver's early engine (engines/vllm_early.py) is told to stop when the run ends, also
    # when it fails before its rows start (here: the input's read), so that no engine outlives
    # its job in a long-lived Python process (a notebook)
    import llmbatch.jobs.run as run_module
    from llmbatch.engines import vllm_early

    launched = []

    def launch_engine(job):
        # a launcher standing in: it ends when its stdin closes, as the real one does
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        vllm_early._launched["key"] = vllm_early.Launch(proc, str(tmp_path / "attach.json"), "key", "")
        launched.append(proc)

    def read_input(job):
        raise JobError("the input could not be read")

    monkeypatch.setattr(run_module, "launch_engine", launch_engine)
    monkeypatch.setattr(run_module, "read_input", read_input)
    with pytest.raises(JobError, match="could not be read"):
        run_job(load_job(write_job(tmp_path)), quiet=True)
    assert launched, "the job should have launched its engine before its read"
    assert launched[0].wait(timeout=30) == 0, "the launcher should be told to stop"
    assert vllm_early._launched == {}
