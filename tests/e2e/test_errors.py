"""Bad rows become error rows, the rest are answered, and failed rows can be retried.

One CSV mixes good rows with many kinds of bad rows; a job runs it on the real engine and
every row must end up in the output or in errors.jsonl, with the stage and error type of
what is wrong with it.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from inproc import llmbatch
from own_cluster import engines
from waiting import committed, wait_for

pytestmark = pytest.mark.e2e

MAX_LEN = 256
ROWS_KILLED = 64  # the engine-kill test's rows

HOOKS = r'''
import json

from llmbatch.jobs.prompts import render


def request(row):
    kind, text = row["kind"], row["text"]
    extra = json.loads(row["payload"]) if row["payload"] else {}
    params = {"temperature": 0, "max_tokens": 4}
    if kind == "good":
        return {"messages": [{"role": "user", "content": f"Say hi to {text}."}], "sampling_params": params}
    if kind in ("huge_cell", "non_utf8", "wrong_fields"):
        return {"messages": [{"role": "user", "content": text}], "sampling_params": params}
    if kind in ("at_max_len", "too_long", "empty_prompt"):
        return {"prompt": extra["prompt"], "sampling_params": params}
    if kind == "max_tokens_no_fit":
        return {"prompt": extra["prompt"], "sampling_params": {**params, "max_tokens": 200}}
    if kind in ("neg_temperature", "unknown_param", "wrong_type", "n_zero", "stop_wrong_type"):
        return {"messages": [{"role": "user", "content": text}], "sampling_params": {**params, **extra}}
    if kind in ("bad_schema", "bad_regex", "truncated_json"):
        return {"messages": [{"role": "user", "content": text}], "sampling_params": extra}
    if kind in ("empty_messages", "bad_shape", "none_content", "not_image"):
        return {"messages": extra["messages"], "sampling_params": params}
    if kind in ("nan_value", "missing_field"):
        return {"messages": [{"role": "user", "content": render(extra["template"], extra["values"])}],
                "sampling_params": params}
    if kind == "preprocess_crash":
        return {"messages": [{"role": "user", "content": row["no_such_column"]}]}
    if kind == "postprocess_crash":
        return {"messages": [{"role": "user", "content": "Say yes."}], "sampling_params": params}
    raise AssertionError(kind)


def output(row):
    if row["kind"] == "postprocess_crash":
        return {"id": row["id"], "answer": 1 / 0}
    return {"id": row["id"], "kind": row["kind"], "answer": row["generated_text"]}
'''

#: kind -> (stage, error type) it must fail with
BAD = {
    "non_utf8": ("read", "UnicodeDecodeError"),
    "wrong_fields": ("read", "CSVRecordError"),
    "huge_cell": ("tokenize", "PromptTooLongError"),
    "at_max_len": ("tokenize", "PromptTooLongError"),
    "too_long": ("tokenize", "PromptTooLongError"),
    "max_tokens_no_fit": ("tokenize", "PromptTooLongError"),
    "empty_prompt": ("tokenize", "RowValidationError"),
    "neg_temperature": ("validate", "RowValidationError"),
    "unknown_param": ("validate", "RowValidationError"),
    "wrong_type": ("validate", "RowValidationError"),
    "n_zero": ("validate", "RowValidationError"),
    "stop_wrong_type": ("validate", "RowValidationError"),
    "bad_schema": ("validate", "RowValidationError"),
    "bad_regex": ("validate", "RowValidationError"),
    "truncated_json": ("check_output", "StructuredOutputError"),
    # the job runs the multimodal stage, the first to read messages: it checks their shape
    "empty_messages": ("prepare_multimodal", "RowValidationError"),
    "bad_shape": ("prepare_multimodal", "RowValidationError"),
    "none_content": ("prepare_multimodal", "RowValidationError"),
    "not_image": ("prepare_multimodal", "RowValidationError"),
    "nan_value": ("preprocess", "RowValidationError"),
    "missing_field": ("preprocess", "RowValidationError"),
    "preprocess_crash": ("preprocess", "KeyError"),
    "postprocess_crash": ("postprocess", "ZeroDivisionError"),
}
#: kinds that a larger max_model_len fixes
FIXED_BY_LONGER_CONTEXT = {"at_max_len", "too_long", "max_tokens_no_fit"}


def exact_prompt(tokenizer, n_tokens: int) -> str:
    text = "hello" + " hello" * (n_tokens - 1)
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    assert len(ids) == n_tokens, len(ids)
    return text


def build_dataset(path: Path, tokenizer) -> dict[str, str]:
    """Write the mixed CSV; returns id -> kind."""
    payloads = {
        "at_max_len": {"prompt": exact_prompt(tokenizer, MAX_LEN)},
        "too_long": {"prompt": exact_prompt(tokenizer, MAX_LEN + 150)},
        "max_tokens_no_fit": {"prompt": exact_prompt(tokenizer, 120)},
        "empty_prompt": {"prompt": "   "},
        "neg_temperature": {"temperature": -1.0},
        "unknown_param": {"max_token": 5},
        "wrong_type": {"max_tokens": "ten"},
        "n_zero": {"n": 0},
        "stop_wrong_type": {"stop": 5},
        "bad_schema": {"max_tokens": 20, "structured_outputs": {"json": {"type": "objectt"}}},
        "bad_regex": {"max_tokens": 20, "structured_outputs": {"regex": "([a-z"}},
        "truncated_json": {"max_tokens": 3, "structured_outputs": {"json": {
            "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
        "empty_messages": {"messages": []},
        "bad_shape": {"messages": [{"content": "no role"}]},
        "none_content": {"messages": [{"role": "user", "content": None}]},
        "not_image": {"messages": [{"role": "user", "content": [
            {"type": "image", "image": "data:image/png;base64,bm90IGFuIGltYWdl"}, {"type": "text", "text": "What is it?"}]}]},
        "nan_value": {"template": "Tell me about {city}.", "values": {"city": float("nan")}},
        "missing_field": {"template": "Tell me about {country}.", "values": {"city": "Oslo"}},
    }
    kinds = {}
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["id", "kind", "text", "payload"])
    lines = [buf.getvalue().encode()]
    n = 0

    def add(kind: str, text: str, payload: dict | None = None) -> None:
        nonlocal n
        n += 1
        kinds[f"r{n:03d}"] = kind
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerow([f"r{n:03d}", kind, text, json.dumps(payload) if payload else ""])
        lines.append(out.getvalue().encode())

    for i in range(12):
        add("good", f"customer {i}")
    for kind in BAD:
        if kind == "non_utf8":
            n += 1
            kinds[f"r{n:03d}"] = kind
            lines.append(f"r{n:03d},non_utf8,".encode() + b"caf\xe9 latte,\n")
        elif kind == "wrong_fields":
            n += 1
            kinds[f"r{n:03d}"] = kind
            lines.append(f"r{n:03d},wrong_fields\n".encode())
        elif kind == "huge_cell":
            add(kind, "word " * 200_000)  # a 1 MB cell
        else:
            add(kind, "Tell me a fact.", payloads.get(kind))
    for i in range(12, 20):
        add("good", f"customer {i}")
    path.write_bytes(b"".join(lines))
    return kinds


def run_cli(*args) -> subprocess.CompletedProcess:
    """The CLI in this process (tests/e2e/inproc.py): what these jobs do, not their process."""
    return llmbatch(*args)


@pytest.fixture(scope="module")
def bad_job(ray_cluster, smollm2, tmp_path_factory):
    from llmbatch.models import load_tokenizer

    tmp = tmp_path_factory.mktemp("errors")
    kinds = build_dataset(tmp / "mixed.csv", load_tokenizer(smollm2))
    (tmp / "hooks.py").write_text(HOOKS)
    (tmp / "job.yaml").write_text(textwrap.dedent(f"""
        input: {{path: mixed.csv, id_column: id}}
        model:
          source: smollm2-135m-instruct
          engine_kwargs: {{max_model_len: {MAX_LEN}}}
          prepare_multimodal_stage: true
          batch_size: 8
        preprocess: hooks:request
        postprocess: hooks:output
        output: {{path: out/answers.jsonl}}
    """))
    proc = run_cli("run", str(tmp / "job.yaml"), "--quiet")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    job_dir = tmp / "out" / "answers.jsonl.job"
    return tmp, job_dir, kinds


def read_results(job_dir: Path) -> tuple[list[dict], list[dict]]:
    stats = json.loads((job_dir / "stats.json").read_text())
    ok = [json.loads(line) for line in Path(stats["output"]).read_text().splitlines()]
    errors = [json.loads(line) for line in (job_dir / "errors.jsonl").read_text().splitlines()]
    return ok, errors


def test_every_bad_row_is_an_error_row_with_stage_and_type(bad_job):
    _, job_dir, kinds = bad_job
    ok, errors = read_results(job_dir)
    assert set(kinds.values()) == set(BAD) | {"good"}  # every kind of bad row is in the input
    assert sorted([r["id"] for r in ok] + [e["id"] for e in errors]) == sorted(kinds), "lost or duplicated rows"
    good = sorted(i for i, k in kinds.items() if k == "good")
    assert sorted(r["id"] for r in ok) == good
    assert all(r["answer"] for r in ok)
    got = {e["id"]: (e["stage"], e["error_type"]) for e in errors}
    for rid, kind in kinds.items():
        if kind != "good":
            assert got.get(rid) == BAD[kind], (kind, got.get(rid), [e for e in errors if e["id"] == rid])
    for e in errors:
        assert e["message"], e
        if e["stage"] not in ("read",):
            assert e["row"]["kind"] == kinds[e["id"]]
    huge = next(e for e in errors if kinds[e["id"]] == "huge_cell")
    assert len(json.dumps(huge["row"])) < 20_000  # the 1 MB cell is cut in the error file


def test_status_counts_errors_by_type(bad_job):
    _, job_dir, kinds = bad_job
    proc = run_cli("status", str(job_dir), "--json")
    info = json.loads(proc.stdout)
    assert info["state"] == "finished"
    assert info["rows_error"] == len(BAD) and info["rows_ok"] == 20
    assert info["errors_by_type"]["tokenize: PromptTooLongError"] == 4
    assert info["errors_by_type"]["validate: RowValidationError"] == 7


def test_retry_errors_with_a_longer_context_answers_those_rows(bad_job):
    tmp, job_dir, kinds = bad_job
    # 512: the suite's usual engine, warm on the worker (the longest of these rows needs 410 tokens)
    proc = run_cli("retry-errors", str(job_dir), "--quiet", "--set", "model.engine_kwargs.max_model_len=512")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ok, errors = read_results(job_dir)
    ids = [r["id"] for r in ok] + [e["id"] for e in errors]
    assert sorted(ids) == sorted(kinds) and len(ids) == len(set(ids)), "every id exactly once"
    answered = {kinds[r["id"]] for r in ok}
    assert FIXED_BY_LONGER_CONTEXT <= answered
    still = {kinds[e["id"]] for e in errors}
    assert still == set(BAD) - FIXED_BY_LONGER_CONTEXT
    # resuming with the original config is now refused: the job's answers came from the new one
    meta = json.loads((job_dir / "job.json").read_text())
    assert meta["config_history"] and "max_model_len" in meta["config_history"][-1]["changes"][0]
    refused = run_cli("run", str(tmp / "job.yaml"), "--quiet")
    assert refused.returncode == 2 and "different config" in refused.stderr, refused.stderr[-2000:]
    assert "max_model_len: 512 -> 256" in " ".join(refused.stderr.split())


def test_an_output_column_the_answers_lack_stops_the_job_at_its_first_part(ray_cluster, smollm2, tmp_path):
    """A misspelt ``output.columns`` name fails the job once its first answered part is committed
    (it failed when the output was written, after every row was answered); the job run again
    with the name fixed keeps what was committed and does the rest."""
    from llmbatch.sample_data import write_customers_csv

    rows = 64
    write_customers_csv(tmp_path / "c.csv", rows, seed=7)
    job = textwrap.dedent("""
        input: {path: c.csv, id_column: Index}
        model: {source: smollm2-135m-instruct, engine_kwargs: {max_model_len: 512}, batch_size: 4,
                max_concurrent_batches: 1}
        prompt: {user: "Customer {Index}: name {Company}'s industry."}
        sampling_params: {max_tokens: 4, temperature: 0}
        output: {path: out/o.parquet, columns: [Index, COLUMN]}
        commit_rows: 4
    """)
    (tmp_path / "job.yaml").write_text(job.replace("COLUMN", "generated_txt"))
    proc = run_cli("run", str(tmp_path / "job.yaml"), "--quiet")
    final = proc.stderr[proc.stderr.rfind("error:"):]
    assert proc.returncode == 2 and "output.columns names ['generated_txt'], which the answered rows" in final, final
    assert "'generated_text'" in final and "run the job again" in final, final
    job_dir = tmp_path / "out" / "o.parquet.job"
    assert 4 <= committed(job_dir) < rows, "the job should stop at its first parts, not after every row"
    (tmp_path / "job.yaml").write_text(job.replace("COLUMN", "generated_text"))
    again = run_cli("run", str(tmp_path / "job.yaml"), "--quiet")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    table = pq.read_table(tmp_path / "out" / "o.parquet")
    assert table.column_names == ["Index", "generated_text"]
    assert sorted(int(i) for i in table.column("Index").to_pylist()) == list(range(1, rows + 1))


def test_engine_that_cannot_start_fails_fast_with_its_reason(ray_cluster, smollm2, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"q": "hi"}\n')
    start = time.monotonic()
    proc = run_cli("run", "--input", str(tmp_path / "in.jsonl"), "--model", "smollm2-135m-instruct",
                   "--prompt", "{q}", "--output", str(tmp_path / "o.parquet"), "--quiet",
                   "--set", "model.engine_kwargs.max_model_len=100000")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    final = proc.stderr[proc.stderr.rindex("error:"):]
    assert "could not start" in final and "max_model_len (100000) is greater than" in " ".join(final.split()), final
    assert time.monotonic() - start < 300


def test_killing_the_engine_process_loses_no_row(ray_cluster, smollm2, tmp_path):
    from llmbatch.sample_data import write_customers_csv

    write_customers_csv(tmp_path / "c.csv", ROWS_KILLED, seed=5)
    log = open(tmp_path / "driver.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "llmbatch", "run", "--input", str(tmp_path / "c.csv"),
                          "--id-column", "Index", "--model", "smollm2-135m-instruct",
                          "--prompt", "Customer #{Index}: describe {Company} in one sentence.",
                          "--output", str(tmp_path / "o.parquet"), "--max-tokens", "32", "--quiet",
                          "--set", "sampling_params.ignore_eos=true", "--set", "commit_seconds=1",
                          # the engine is this replica's own (not a warm host's): its process is killed
                          "--set", "model.keep_warm_s=0",
                          "--set", "model.batch_size=8", "--set", "model.max_concurrent_batches=2"],
                         stdout=log, stderr=subprocess.STDOUT, env=os.environ, start_new_session=True)
    job_dir = tmp_path / "o.parquet.job"

    wait_for(lambda: committed(job_dir) >= 8, 900, "the first committed rows", p, step=0.2)
    # this job's engine: started after its driver (an earlier test's replica may still be going
    # away with its engine: a fresh run once saw no single engine for 20 s); the process table is
    # read while Ray's workers come and go, so look again for a while before deciding
    born = psutil.Process(p.pid).create_time()

    def cores() -> list:
        found = []
        for _, core in engines("MapWorker"):
            try:
                if core.create_time() >= born:
                    found.append(core)
            except psutil.Error:
                continue  # gone since the table was read
        return found

    wait_for(lambda: len(cores()) == 1, 60, "this job's one engine process", p, step=0.5)
    found = cores()
    assert len(found) == 1 and committed(job_dir) < ROWS_KILLED, "the job should still be running"
    found[0].send_signal(signal.SIGKILL)
    assert p.wait(timeout=900) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    stats = json.loads((job_dir / "stats.json").read_text())
    table = pq.read_table(stats["output"])
    assert sorted(int(i) for i in table.column("Index").to_pylist()) == list(range(1, ROWS_KILLED + 1))
    assert stats["rows_error"] == 0
    assert stats["engine_restarts"] >= 1
