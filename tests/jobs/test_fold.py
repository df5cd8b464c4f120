"""Folding identical rows in the driver (jobs/fold.py): which rows go to the engine, and the
followers built from their own input columns and their group's answer, committed once each.

The representatives' output rows are made here (the engine's part is not what these test);
tests/e2e/test_workload_optimizations.py runs folded jobs on the real engine."""

from __future__ import annotations

import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmbatch.codec import decode_rows, encode_rows, rows_to_table
from llmbatch.jobs import fold as fold_module
from llmbatch.jobs import ingest as ingest_module
from llmbatch.jobs.driver import Committer
from llmbatch.jobs.fold import Fold, group_codes
from llmbatch.jobs.ingest import ingest, input_rows
from llmbatch.jobs.meta import JobMeta
from llmbatch.jobs.store import JobDir
from llmbatch.progress import Progress
from llmbatch.rows import ANSWER, ERROR_COLUMN, ROW_ID, STATS

COMPANIES = ["Acme", "Birch", "Acme", "Cobalt", "Birch", "Acme", None, "Dune", "Acme", None, "Cobalt", "Acme"]


def test_group_codes_are_dense_and_equal_values_share_one():
    table = pa.table({"a": ["x", "y", "x", None, None, "y"], "b": [1, 1, 1, 2, 2, 2]})
    one = group_codes(table, ["a"])
    assert one[0] == one[2] and one[1] == one[5] and one[3] == one[4]
    assert len(set(one.tolist())) == 3 and set(one.tolist()) == {0, 1, 2}
    two = group_codes(table, ["a", "b"])
    assert two[0] == two[2] and two[3] == two[4] and two[1] != two[5]  # ("y", 1) and ("y", 2) differ
    assert set(two.tolist()) == set(range(4))
    lists = pa.table({"m": [[1, 2], [1, 2], [3]]})  # a type Arrow cannot hash: compared as text
    codes = group_codes(lists, ["m"])
    assert codes[0] == codes[1] != codes[2]


@pytest.fixture
def job(tmp_path, monkeypatch):
    """An ingested job of 12 rows in three input files of 5, 5 and 2 rows."""
    monkeypatch.setattr(ingest_module, "INGEST_ROWS", 5)
    with open(tmp_path / "in.jsonl", "w") as fh:
        for i, company in enumerate(COMPANIES):
            fh.write(json.dumps({"Index": f"cust-{i}", "Company": company, "City": f"city {i}"}) + "\n")
    job = JobDir(tmp_path / "job")
    job.root.mkdir()
    learned = ingest(job, str(tmp_path / "in.jsonl"), None, None, None, None)
    job.write_meta(JobMeta(spec={}, result_fields={}, numerics_fields={}, config_hash="", rows=learned["rows"],
                           ingested=True, ingest_rows=5, columns=learned["columns"]))
    return job


def answered(job: JobDir, ids) -> pa.Table:
    """The processor's output rows for ``ids`` (each row's input columns and an answer that
    names its company; an empty company fails as the template would)."""
    rows = []
    for path in job.input_files():
        for row in input_rows(path, np.asarray(ids)):
            company = row["Company"]
            if company is None:
                row.update({ERROR_COLUMN: "preprocess: RowValidationError: template field {Company} is empty",
                            "generated_text": "", STATS: None, ANSWER: None})
            else:
                row.update({ERROR_COLUMN: "", "generated_text": f"about {company}", "num_generated_tokens": 2,
                            "messages": [{"role": "user", "content": f"What does {company} do?"}],
                            STATS: {"replica": "r0", "deduped": False, "in_flight": 3},
                            ANSWER: f'{{"k":"{company}"}}'})
            rows.append(row)
    return encode_rows(rows)


def folding(job: JobDir, commit_rows: int = 100, progress: Progress | None = None,
            fold: Fold | None = None) -> tuple[Fold, Committer, np.ndarray]:
    """A first pass's fold over every row, and the committer the driver gives it."""
    rows = len(COMPANIES)
    fold = fold or Fold(job.input_files(), 5, np.ones(rows, dtype=bool), ["Company"])
    done = np.zeros(rows, dtype=bool)
    committer = Committer(job, done, progress or Progress(rows, tty=False, quiet=True), commit_rows=commit_rows,
                          commit_seconds=3600, fold=fold)
    return fold, committer, done


def committed(job: JobDir) -> list[dict]:
    return pa.concat_tables([pq.read_table(p) for p in job.part_files()], promote_options="permissive").to_pylist()


def test_one_row_per_group_goes_to_the_engine_and_the_rest_take_its_answer(job):
    rows = len(COMPANIES)
    todo = np.ones(rows, dtype=bool)
    fold = Fold(job.input_files(), 5, todo, ["Company"])
    # the first row of each group: Acme 0, Birch 1, Cobalt 3, None 6, Dune 7
    assert np.flatnonzero(fold.send).tolist() == [0, 1, 3, 6, 7]
    assert fold.followers == rows - 5
    progress = Progress(rows, tty=False, quiet=True)
    _, committer, done = folding(job, commit_rows=4, progress=progress, fold=fold)
    committer.add(answered(job, [0, 1]))
    committer.add(answered(job, [3, 6, 7]))
    committer.flush()
    out = {r[ROW_ID]: r for r in committed(job)}
    assert sorted(out) == list(range(rows)), "every row once"
    assert max(pq.read_metadata(p).num_rows for p in job.part_files()) <= 4
    for i, company in enumerate(COMPANIES):
        row = out[i]
        assert row["Index"] == f"cust-{i}" and row["City"] == f"city {i}", "a follower keeps its own columns"
        if company is None:
            assert "RowValidationError" in row[ERROR_COLUMN] and row["generated_text"] == ""
            continue
        assert row[ERROR_COLUMN] == "" and row["generated_text"] == f"about {company}"
        assert json.loads(row["messages"])[0]["content"] == f"What does {company} do?"  # JSON text, as committed
        first = COMPANIES.index(company)
        assert row[STATS]["deduped"] == (i != first), i
        assert row[STATS]["in_flight"] == 3
        assert (row[ANSWER] is not None) == (i == first), "only the row that reached the engine records the answer"
    snap = progress.snapshot()["this_run"]
    assert snap["ok"] == 10 and snap["errors"] == 2 and snap["deduplicated_rows"] == 6
    assert done.all()


def test_followers_of_a_lost_representative_stay_to_do_and_fold_again(job):
    _, committer, done = folding(job)
    committer.add(answered(job, [1, 3, 6, 7]))  # Acme's row 0 never comes back (a replica died)
    committer.flush()
    acme = [i for i, c in enumerate(COMPANIES) if c == "Acme"]
    assert np.flatnonzero(~done).tolist() == acme
    again = Fold(job.input_files(), 5, ~done, ["Company"])  # the next pass
    assert np.flatnonzero(again.send).tolist() == [0] and again.followers == len(acme) - 1


def test_followers_wait_for_their_file_or_the_next_commit(job, monkeypatch):
    monkeypatch.setattr(fold_module, "EMIT_ROWS", 10**6)
    rows = len(COMPANIES)
    done = np.zeros(rows, dtype=bool)
    fold = Fold(job.input_files(), 5, np.ones(rows, dtype=bool), ["Company"])
    # Acme's and Birch's answers: file 0 (rows 0-4) has followers 2 (Acme) and 4 (Birch), all ready
    ready = fold.answered(rows_to_table(decode_rows(answered(job, [0, 1]))), done)
    assert sorted(i for t in ready for i in t.column(ROW_ID).to_pylist()) == [2, 4]
    # Cobalt's answer: file 2 (rows 10-11: Cobalt, Acme) is all ready; file 1 (rows 5-9) waits
    # for the empty company's group (row 6 leads it, row 9 follows)
    ready = fold.answered(rows_to_table(decode_rows(answered(job, [3]))), done)
    assert sorted(i for t in ready for i in t.column(ROW_ID).to_pylist()) == [10, 11]
    later = fold.emit(done, everything=True)  # a timed commit takes what is ready
    assert sorted(i for t in later for i in t.column(ROW_ID).to_pylist()) == [5, 8]
    assert fold.emit(done, everything=True) == []


def test_rows_that_could_not_be_read_are_never_folded(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest_module, "INGEST_ROWS", 5)
    (tmp_path / "in.jsonl").write_text('{"Company": "Acme"}\n{"Company": \n{"Company": "Acme"}\n')
    job = JobDir(tmp_path / "job")
    job.root.mkdir()
    ingest(job, str(tmp_path / "in.jsonl"), None, None, None, None)
    fold = Fold(job.input_files(), 5, np.ones(3, dtype=bool), ["Company"])
    assert fold.send.tolist() == [True, True, False] and fold.followers == 1


def test_rows_fold_only_where_the_prompt_alone_decides_a_deterministic_request(tmp_path):
    from llmbatch.jobs.kinds import job_for
    from llmbatch.jobs.spec import load_job

    (tmp_path / "data.csv").write_text("Index,Company,City\n1,Acme,Oslo\n")
    (tmp_path / "hooks.py").write_text("def post(row):\n    return row\n")

    def columns(prompt=None, sampling=None, input_columns=("Index", "Company", "City"), **more):
        spec = load_job(data={"input": {"path": str(tmp_path / "data.csv")},
                              "model": {"source": "smollm2-135m-instruct", **more.pop("model", {})},
                              "prompt": prompt or {"system": "Answer for {City}.", "user": "What is {Company}?"},
                              "sampling_params": {"temperature": 0} if sampling is None else sampling,
                              "output": {"path": str(tmp_path / "out.parquet")}, **more})
        meta = JobMeta(spec={}, result_fields={}, numerics_fields={}, config_hash="", rows=1,
                       columns=list(input_columns))
        return job_for(spec, meta).kind.fold_columns(job_for(spec, meta))

    assert columns() == ["City", "Company"]
    assert columns(sampling={"temperature": 0.7, "seed": 3}) == ["City", "Company"]  # a seed decides too
    assert columns(sampling={"temperature": 0.7}) is None        # sampled: every row its own answer
    assert columns(sampling={}) is None                          # the engine's default may sample
    assert columns(sampling={"temperature": 0, "n": 2}) is None
    assert columns(model={"dedup_requests": False}) is None      # the user turned copies off
    assert columns(postprocess="hooks:post", python_path=[str(tmp_path)]) is None  # runs per row
    assert columns(input_columns=("Company", "City", "prompt")) is None  # an input column the engine overwrites
    assert columns(prompt={"prompt_column": "Company"}) == ["Company"]


def test_answers_are_let_go_once_their_followers_are_built(job):
    rows = len(COMPANIES)
    fold, committer, done = folding(job)
    committer.add(answered(job, [7]))  # Dune: a group of one, nothing to keep
    assert fold.answers.chunks == [None]
    committer.add(answered(job, [0]))  # Acme: its followers wait for their files' other groups
    assert fold.answers.chunks[1] is not None
    committer.add(answered(job, [1, 3, 6]))  # every file is ready: everything is built
    assert fold.answers.chunks == [None, None, None] and fold.left.sum() == 0
    committer.flush()
    assert sorted(r[ROW_ID] for r in committed(job)) == list(range(rows))


def test_an_input_file_is_read_once_while_its_followers_are_built_and_let_go_after(job, monkeypatch):
    """Followers are built a few at a time as their representatives come back; their input file
    is decoded once (a 2,000,000-row job read each of its files about 150 times), kept while the
    file has followers to build, and let go once it has none; a small cache reads again rather
    than grow."""
    monkeypatch.setattr(fold_module, "EMIT_ROWS", 1)  # every answer emits what it made ready
    reads = []
    real = fold_module.pq.read_table

    def counting(path, *args, **kwargs):
        # the builds' reads: whole files, from jobs/fold.py (its set-up selects columns; the
        # answers made here read with jobs/ingest.py)
        if not args and not kwargs and sys._getframe(1).f_code.co_filename == fold_module.__file__:
            reads.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(fold_module.pq, "read_table", counting)
    fold, committer, done = folding(job)
    for rep in (0, 1, 3, 7):
        committer.add(answered(job, [rep]))
    assert len(reads) == len(set(reads)), reads
    assert list(fold._inputs) == [1]  # file 1 waits for row 9 (the empty company's group); files 0 and 2 are done
    committer.add(answered(job, [6]))
    committer.flush()
    assert sorted(r[ROW_ID] for r in committed(job)) == list(range(len(COMPANIES)))
    assert fold._inputs == {}, "every file's followers are built: none is kept"
    monkeypatch.setattr(fold_module, "INPUT_CACHE_BYTES", 1)  # room for one file only
    reads.clear()
    fold, committer, done = folding(job, fold=Fold(job.input_files(), 5, np.ones(len(COMPANIES), dtype=bool),
                                                   ["Company"]))
    for rep in (0, 1, 3, 6, 7):
        committer.add(answered(job, [rep]))
    assert len(fold._inputs) <= 1


def test_followers_are_built_a_slice_at_a_time_behind_the_answers_and_all_at_the_end(job, monkeypatch):
    """A batch of answers makes many followers ready (a skewed job's first answers carry most of
    its rows); the driver builds them a slice at a time, so it goes back to taking answers, and
    a commit writes the answered rows before their followers; the end of the stream builds the
    rest."""
    monkeypatch.setattr(fold_module, "BUILD_SLICE", 1)
    monkeypatch.setattr("llmbatch.jobs.driver.BUILD_SLICE", 1)
    fold, committer, done = folding(job)
    committer.add(answered(job, [0, 1, 3, 6, 7]))  # every follower is ready: files 0, 1 and 2
    assert sorted(fold.ready) == [1, 2], "one slice built (file 0's followers 2 and 4), the rest wait"
    with committer._lock:
        committer._flush()  # a timed commit: the answers, file 0's followers and one more slice
    assert sorted(fold.ready) == [2]
    committer.wait_written()
    first = pq.read_table(job.part_files()[0]).column(ROW_ID).to_pylist()
    assert first[:5] == [0, 1, 3, 6, 7] and sorted(first[5:]) == [2, 4, 5, 8, 9], first
    committer.flush()  # the end of the stream: everything
    assert fold.ready == {} and done.all()
    assert sorted(r[ROW_ID] for r in committed(job)) == list(range(len(COMPANIES)))


def test_followers_whose_answers_came_in_chunks_of_other_types_are_built_from_each_chunk(job):
    """Answers of one column order whose types do not join (a column of numbers in one batch,
    of text in the next): the followers are built a table per chunk, each with its own
    representative's answer."""
    fold, committer, done = folding(job)
    for ids, score in (([0, 1], 7), ([3, 6, 7], "high")):
        table = rows_to_table(decode_rows(answered(job, ids)), {"messages"})
        committer.add(table.append_column("score", pa.array([score] * len(ids))))
    committer.flush()
    out = {r[ROW_ID]: r for r in committed(job)}
    assert sorted(out) == list(range(len(COMPANIES))), "every row once"
    for i, company in enumerate(COMPANIES):
        if company is None:
            continue
        assert out[i]["generated_text"] == f"about {company}", i
        assert str(out[i]["score"]) == ("7" if company in ("Acme", "Birch") else "high"), i
