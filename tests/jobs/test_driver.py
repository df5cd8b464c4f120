"""The driver's Committer: repeats dropped, parts committed by size and by time, counts shown."""

from __future__ import annotations

import time

import numpy as np

from llmbatch.codec import encode_rows
from llmbatch.jobs.driver import Committer
from llmbatch.jobs.meta import JobMeta
from llmbatch.jobs.store import JobDir
from llmbatch.progress import Progress
from llmbatch.rows import ERROR_COLUMN, ROW_ID, STATS


def answered(ids, error_ids=(), deduped_ids=()):
    return encode_rows([{ROW_ID: i, "generated_text": f"a{i}", "num_input_tokens": 5, "num_generated_tokens": 3,
                         ERROR_COLUMN: "engine: ValueError: no" if i in error_ids else "",
                         STATS: {"replica": "r", "deduped": i in deduped_ids}} for i in ids])


def job_with(tmp_path, rows):
    job = JobDir(tmp_path / "job")
    job.write_meta(JobMeta(spec={}, result_fields={}, numerics_fields={}, config_hash="", rows=rows, ingested=True))
    return job


def test_repeats_are_dropped_and_parts_commit_by_size(tmp_path):
    job = job_with(tmp_path, 10)
    done = np.zeros(10, dtype=bool)
    progress = Progress(10, tty=False, quiet=True)
    c = Committer(job, done, progress, commit_rows=4, commit_seconds=3600)
    c.add(answered([0, 1, 2]))
    assert job.part_files() == []                  # under commit_rows: buffered
    c.add(answered([2, 3, 3]))                     # a retried task brings 2 again, and 3 twice
    c.wait_written()                               # (parts are written on the committer's writer thread)
    assert len(job.part_files()) == 1 and c.duplicates == 2
    c.add(answered([4, 5], error_ids={5}, deduped_ids={4}))
    c.flush()
    assert len(job.part_files()) == 2
    assert job.state().counts() == {"rows": 10, "done": 6, "ok": 5, "errors": 1, "todo": 4}
    assert done.tolist() == [True] * 6 + [False] * 4
    snap = progress.snapshot()["this_run"]
    assert snap["ok"] == 5 and snap["errors"] == 1
    assert snap["delivered_tokens"] == 15 and snap["generated_tokens"] == 12  # row 4 was a dedup copy


def test_parts_commit_by_time(tmp_path):
    job = job_with(tmp_path, 4)
    c = Committer(job, np.zeros(4, dtype=bool), Progress(4, tty=False, quiet=True), commit_rows=1000,
                  commit_seconds=0.05)
    c.add(answered([0]))
    time.sleep(0.1)
    c.add(answered([1]))
    c.wait_written()
    assert len(job.part_files()) == 1 and job.state().counts()["done"] == 2


def test_a_part_that_cannot_be_written_stops_the_stream_and_is_not_counted(tmp_path):
    job = job_with(tmp_path, 8)
    progress = Progress(8, tty=False, quiet=True)
    c = Committer(job, np.zeros(8, dtype=bool), progress, commit_rows=2, commit_seconds=3600)
    written = job.commit_parts

    def full_disk(tables):
        if any(ROW_ID in t.column_names and 2 in t.column(ROW_ID).to_pylist() for t in tables):
            raise OSError(28, "No space left on device")
        return written(tables)

    job.commit_parts = full_disk
    c.add(answered([0, 1]))
    c.wait_written()
    assert len(job.part_files()) == 1 and progress.snapshot()["this_run"]["ok"] == 2
    c.add(answered([2, 3]))                        # handed to the writer, whose write fails
    try:
        c.flush()
    except OSError as exc:
        assert exc.errno == 28
    else:
        raise AssertionError("a part that could not be written went unnoticed")
    c.close()
    assert len(job.part_files()) == 1, "nothing of the failed part is on disk"
    assert progress.snapshot()["this_run"]["ok"] == 2, "rows whose part failed were counted as committed"


def test_answer_records_are_tagged_with_the_model_settings_not_placement(tmp_path):
    import textwrap

    from llmbatch.jobs.driver import answer_tag
    from llmbatch.jobs.kinds import job_for
    from llmbatch.jobs.spec import load_job

    (tmp_path / "data.csv").write_text("Index,Company\n1,Acme\n")
    (tmp_path / "job.yaml").write_text(textwrap.dedent("""
        input: {path: data.csv, id_column: Index}
        model: {source: smollm2-135m-instruct, engine_kwargs: {max_model_len: 512}}
        prompt: {user: "Which industry is {Company} in?"}
        output: {path: out/result.parquet}
    """))
    tag = answer_tag(job_for(load_job(tmp_path / "job.yaml")))
    assert answer_tag(job_for(load_job(tmp_path / "job.yaml", overrides=["model.concurrency=2"]))) == tag
    # another dtype or model: the job's recorded answers are not copied, they are recomputed
    assert answer_tag(job_for(load_job(tmp_path / "job.yaml", overrides=["model.engine_kwargs.dtype=float32"]))) != tag
    assert answer_tag(job_for(load_job(tmp_path / "job.yaml", overrides=["model.source=all-minilm-l6-v2"]))) != tag


def test_answered_rows_are_committed_on_time_while_no_new_batch_arrives(tmp_path):
    job = job_with(tmp_path, 10)
    done = np.zeros(10, dtype=bool)
    progress = Progress(10, tty=False, quiet=True)
    c = Committer(job, done, progress, commit_rows=1000, commit_seconds=0.2)
    with c.timer():
        c.add(answered([0, 1, 2]))  # then the stream waits on a long last batch
        deadline = time.monotonic() + 30
        while not job.part_files() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(job.part_files()) == 1, "answered rows waited for the next batch to be committed"
        c.add(answered([3]))
    c.flush()
    assert len(job.part_files()) == 2


def test_rows_the_replicas_output_stage_types_commit_as_rows_that_come_encoded(tmp_path):
    """The job's output stage types its rows in the replica (the driver's one thread only
    commits them): the parts hold what they held when the driver typed encoded rows."""
    import pyarrow.parquet as pq

    from llmbatch.codec import STATE_COLUMN, json_columns_of, table_to_rows
    from llmbatch.jobs.driver import job_output
    from llmbatch.rows import ANSWER

    rows = [{ROW_ID: i, "messages": [{"role": "user", "content": f"q{i}"}], "generated_text": f"a{i}",
             "generated_tokens": [i, 2], "num_generated_tokens": 2, ERROR_COLUMN: "engine: ValueError: no" if i == 2 else "",
             STATS: {"replica": "r", "deduped": False, "cached_tokens": None}, ANSWER: f'{{"k": "{i}"}}'} for i in range(4)]
    output = job_output().bind(task_type="generate", continue_on_error=True, postprocessed=True)
    typed = output.to_table([dict(r) for r in rows])
    assert STATE_COLUMN not in typed.column_names, "the job's rows should leave the replica typed"
    assert json_columns_of(typed.schema) == ["messages"], "the conversation should be JSON text from the first row"
    committed = []
    # (what the stage sent before: the same shaped rows, pickled)
    for name, batch in (("typed", typed), ("encoded", encode_rows([output.shape(dict(r)) for r in rows]))):
        job = job_with(tmp_path / name, 4)
        c = Committer(job, np.zeros(4, dtype=bool), Progress(4, tty=False, quiet=True), commit_rows=1000,
                      commit_seconds=3600)
        c.add(batch)
        c.flush()
        c.close()
        assert job.state().counts() == {"rows": 4, "done": 4, "ok": 3, "errors": 1, "todo": 0}, name
        (part,) = job.part_files()
        committed.append(sorted(table_to_rows(pq.read_table(part)), key=lambda r: r[ROW_ID]))
    typed_rows, encoded_rows = committed
    assert typed_rows == encoded_rows, "typed and encoded rows should commit the same values"
    assert typed_rows[1]["messages"] == [{"role": "user", "content": "q1"}]
