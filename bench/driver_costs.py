"""The driver's own work on a big input, in this process (no Ray, no engine): ingesting a CSV
(pyarrow's reader, and the record reader with --records), folding identical rows, and writing
the output from parts of ``commit_rows`` rows whose answers are made up here.

    python bench/driver_costs.py CUSTOMERS.csv [--records] [--commit-rows 1000] [--dir /tmp/driver-costs]
        [--stream RATE]

``--stream RATE``: instead of the output, the rows phase's driver side: the representatives
arrive in batches of 256 at RATE rows a second (made-up answers in the columns a generation
job's replica sends: the conversation, the prompt, tokens, the stats, the answer record) and go
through the job's ``Committer`` (the fold builds and commits their followers); prints how long
the driver was busy per batch (the longest stall), when each representative was committed
after it arrived (what a SIGKILL at that moment would lose), and the seconds the replicas'
output stage took to make the batches (``replica_s``, all replicas together). ``--encoded``:
the batches come as pickled rows that the driver types (the form before the ninth session).
With ``--stream``, ``--output`` then writes the output from those parts (as a real run's: every
row with its conversation and prompt) and prints its seconds too.

CUSTOMERS.csv: ``llmbatch sample FILE --rows 2000000 --seed 0``. Prints one JSON line of seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from llmbatch.io.csv_tables import csv_tables
from llmbatch.io.readers import read_rows
from llmbatch.jobs.fold import Fold
from llmbatch.jobs.ingest import INGEST_ROWS, ingest
from llmbatch.jobs.kinds import job_for
from llmbatch.jobs.meta import JobMeta
from llmbatch.jobs.spec import load_job
from llmbatch.rows import ANSWER, ERROR_COLUMN, STATS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--records", action="store_true", help="ingest with the record reader only")
    ap.add_argument("--commit-rows", type=int, default=1000)
    ap.add_argument("--dir", default="/tmp/driver-costs")
    ap.add_argument("--stream", type=float, default=0.0, help="representatives a second (see above)")
    ap.add_argument("--encoded", action="store_true", help="with --stream: pickled rows, typed by the driver")
    ap.add_argument("--output", action="store_true", help="with --stream: then write the output from its parts")
    args = ap.parse_args()
    folder = Path(args.dir)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    spec = load_job(data={"input": {"path": str(Path(args.csv).resolve()), "id_column": "Index"},
                          "model": {"source": "smollm2-135m-instruct"}, "prompt": {"user": "What is {Company}?"},
                          "sampling_params": {"temperature": 0},
                          "output": {"path": str(folder / "out.parquet"), "columns": ["Index", "generated_text"]}})
    job = job_for(spec)
    job.dir.root.mkdir(parents=True)
    out: dict = {}
    t = time.time()
    info = ingest(job.dir, args.csv, "csv", None, None, "Index", read_rows(args.csv, "csv"),
                  None if args.records else csv_tables(args.csv))
    out["ingest_s"] = round(time.time() - t, 2)
    job.meta = JobMeta(spec={}, result_fields={}, numerics_fields={}, config_hash="", rows=info["rows"], ingested=True,
                       ingest_rows=INGEST_ROWS, columns=info["columns"], column_types=info["column_types"])
    job.dir.write_meta(job.meta)
    t = time.time()
    fold = Fold(job.dir.input_files(), INGEST_ROWS, np.ones(info["rows"], dtype=bool), ["Company"])
    out.update(fold_s=round(time.time() - t, 2), rows=info["rows"], representatives=int(fold.send.sum()))
    if args.stream:
        out.update(stream(job, fold, info["rows"], args.stream, args.commit_rows, encoded=args.encoded))
        if args.output:
            out.update(write_output(job, info["rows"]))
        print(json.dumps(out))
        return
    t = time.time()
    for path in job.dir.input_files():
        table = pq.read_table(path).drop_columns(["__llmbatch_key"])
        n = table.num_rows
        table = (table.append_column(ERROR_COLUMN, pa.array([""] * n))
                 .append_column("generated_text", pa.array(["Technology"] * n))
                 .append_column("num_generated_tokens", pa.array([3] * n))
                 .append_column(STATS, pa.array([{"replica": "r0", "deduped": True, "in_flight": 5}] * n))
                 .append_column(ANSWER, pa.nulls(n, pa.string())))
        for start in range(0, n, args.commit_rows):
            job.dir.commit(table.slice(start, args.commit_rows))
    out["commit_s"] = round(time.time() - t, 2)
    out.update(write_output(job, info["rows"]))
    print(json.dumps(out))


def write_output(job, rows: int) -> dict:
    """Seconds to scan the parts' state, and to write the output from them."""
    t = time.time()
    state = job.dir.state(rows)
    state_s = round(time.time() - t, 2)
    t = time.time()
    job.kind.write_output(job, state)
    return {"state_s": state_s, "output_s": round(time.time() - t, 2)}


def replica_rows(table: pa.Table) -> list[dict]:
    """Output rows as a generation job's replica hands them to its output stage (made-up
    answers; the columns and their kinds of values as a real run's parts hold them)."""
    rows = table.to_pylist()
    now = time.time()
    for i, row in enumerate(rows):
        user = f"What industry is this company in: {row['Company']}"
        row.update({
            "messages": [{"role": "system", "content": "You classify companies by industry."},
                         {"role": "user", "content": user}],
            "prompt": f"<|im_start|>system\nYou classify companies by industry.<|im_end|>\n<|im_start|>user\n{user}"
                      "<|im_end|>\n<|im_start|>assistant\n",
            "num_input_tokens": 44, "time_taken_llm": 0.5, "request_id": i, "generated_text": "Technology",
            "generated_tokens": [54, 11079, 2], "num_generated_tokens": 3, "finish_reason": "stop",
            "batch_uuid": "a830b9a3e3cb47c38c6e4b1a080301d7", ERROR_COLUMN: "",
            STATS: {"replica": "vm:1", "devices": "0", "cached_tokens": None, "deduped": False,
                    "process_start_at": now, "begin_at": now, "start_at": now, "ready_at": now,
                    "first_request_at": now, "restarts": 0, "finished_at": now, "in_flight": 5},
            ANSWER: json.dumps({"e": "45516335b6e5bfb7", "k": f"{i:032x}",
                                "a": {"num_input_tokens": 44, "generated_text": "Technology"}})})
    return rows


def stream(job, fold: Fold, rows: int, rate: float, commit_rows: int, batch: int = 256, encoded: bool = False) -> dict:
    """The representatives through the driver's Committer at ``rate`` rows a second."""
    from llmbatch.codec import encode_rows
    from llmbatch.jobs.driver import Committer, job_output
    from llmbatch.progress import Progress
    from llmbatch.rows import ROW_ID

    output = job_output().bind(task_type="generate", continue_on_error=True, postprocessed=True)
    replica_s = 0.0

    done = np.zeros(rows, dtype=bool)
    committer = Committer(job.dir, done, Progress(rows, quiet=True), commit_rows, 10.0, fold)
    reps = np.flatnonzero(fold.send)
    inputs = {}
    arrived = np.full(rows, np.nan)
    busy, t0 = [], time.time()
    with committer.timer():
        for start in range(0, len(reps), batch):
            ids = reps[start:start + batch]
            due = t0 + start / rate
            if time.time() < due:
                time.sleep(due - time.time())
            pieces = []
            for f in np.unique(ids // INGEST_ROWS).tolist():
                if f not in inputs:
                    inputs = {**{k: v for k, v in inputs.items() if k >= f - 1},
                              f: pq.read_table(job.dir.input_files()[f]).drop_columns(["__llmbatch_key"])}
                source, mine = inputs[f], ids[ids // INGEST_ROWS == f]
                pieces.append(source.take(pa.array(np.searchsorted(source.column(ROW_ID).to_numpy(), mine))))
            out_rows = replica_rows(pa.concat_tables(pieces))
            t = time.time()
            # as a replica sends them: shaped by the job's output stage, then typed (or pickled, as before)
            sent = encode_rows([output.shape(r) for r in out_rows]) if encoded else output.to_table(out_rows)
            replica_s += time.time() - t
            t = time.time()
            arrived[ids] = t - t0
            committer.add(sent)  # the driver's work on a batch: typing it included, if it came encoded
            busy.append(time.time() - t)
        committer.flush()
    committer.close()
    # when each representative was committed: the parts' modification times, by row id
    committed = np.full(rows, np.nan)
    for path in job.dir.part_files():
        ids = pq.read_table(path, columns=[ROW_ID]).column(0).to_numpy()
        committed[ids] = path.stat().st_mtime - t0
    lag = (committed - arrived)[reps]
    return {"stream_s": round(time.time() - t0, 2), "rate": rate, "batches": len(busy),
            "busy_max_s": round(max(busy), 2), "busy_total_s": round(sum(busy), 2),
            "encoded": encoded, "replica_s": round(replica_s, 2), "driver_s": {k: round(v, 2) for k, v in committer.busy.items()},
            "rep_commit_lag_s": {q: round(float(np.nanpercentile(lag, q)), 2) for q in (50, 90, 99, 100)},
            "parts": len(job.dir.part_files())}


if __name__ == "__main__":
    main()
