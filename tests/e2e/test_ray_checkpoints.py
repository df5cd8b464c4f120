"""Ray Data's own checkpoints keep working with llmbatch's processor.

The seeds' checkpoint example (``tests/e2e/checkpoint_run.py``: 400 rows in 8 Parquet files ->
processor -> ``write_parquet``, ``DataContext.checkpoint_config`` with ``id_column="id"``) on a
2-CPU Ray of its own, against the fake OpenAI-compatible server: SIGKILLed with that Ray once
some output files exist, then run again on the worker's session cluster (``ray_cluster``: a
Ray that is already there, as the first run's is gone); across both runs the written output
holds every id exactly once (the rerun skips what the first run wrote, and Ray drops the files
of writes it had not committed).
Rows the endpoint always refuses are error rows: written once, with their reason, and, as
with Ray, checkpointed like the rest (a rerun does not ask for them again).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from fake_openai import stats
from waiting import wait_for

pytestmark = pytest.mark.e2e

ROWS = 400
FILES = 8
BAD = {i for i in range(ROWS) if i % 50 == 7}  # the endpoint answers 400 to these
HERE = Path(__file__).parent


@pytest.fixture
def server(tmp_path):
    port_file = tmp_path / "port"
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, str(HERE / "fake_openai.py"), "--port-file", str(port_file),
                             "--latency", "0.1"], stdout=log, stderr=log)
    wait_for(port_file.exists, 30, "the fake server's port")
    yield f"http://127.0.0.1:{port_file.read_text()}/v1/chat/completions"
    proc.kill()
    proc.wait()


def written(out: Path) -> dict[int, str]:
    """id -> its __inference_error__ ("" when answered), over every file written; an id twice
    is an error."""
    rows: dict[int, str] = {}
    for f in sorted(out.glob("*.parquet")):
        table = pq.read_table(f)
        errors = table.column("__inference_error__").to_pylist() if "__inference_error__" in table.column_names \
            else [""] * table.num_rows
        for i, error in zip(table.column("id").to_pylist(), errors):
            assert i not in rows, f"id {i} written twice"
            rows[i] = error or ""
    return rows


def attempts(base: str) -> int:
    return stats(base)["attempts"]


def test_a_killed_checkpointed_run_reruns_without_losing_or_repeating_an_id(ray_cluster, server, tmp_path):
    import pandas as pd

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    df = pd.DataFrame({"id": range(ROWS), "name": [f"name {i}" + (" fault=bad400" if i in BAD else "")
                                                   for i in range(ROWS)]})
    for k in range(FILES):
        df.iloc[k * ROWS // FILES:(k + 1) * ROWS // FILES].to_parquet(inputs / f"part-{k}.parquet")
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    cmd = [sys.executable, str(HERE / "checkpoint_run.py"), "--url", server, "--inputs", str(inputs),
           "--out", str(out), "--checkpoint", str(checkpoint)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "run.log"

    first = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    wait_for(lambda: len(list(out.glob("*.parquet"))) >= 2, 600, "two output files", first)
    # the driver and the Ray it started, all at once: Ray's workers need not share the driver's
    # process group, and one left running could write a file after `before` is read
    family = psutil.Process(first.pid).children(recursive=True)
    os.killpg(first.pid, signal.SIGKILL)
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    first.wait(timeout=30)
    gone, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, [p.pid for p in alive]
    before = written(out)
    assert 0 < len(before) < ROWS, len(before)

    base = server.removesuffix("/v1/chat/completions")
    asked_first = attempts(base)
    # the rerun joins the worker's cluster: no second Ray start (the killed run's Ray is gone with it)
    second = subprocess.run([*cmd, "--address", ray_cluster], stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            env=env, timeout=900)
    assert second.returncode == 0, log.read_text()[-4000:]
    rows = written(out)
    assert sorted(rows) == list(range(ROWS)), f"{ROWS - len(rows)} ids lost"
    assert {i for i, error in rows.items() if error} == BAD, sorted(i for i, e in rows.items() if e)
    assert all("HttpStatusError" in rows[i] and "400" in rows[i] for i in BAD), rows[min(BAD)]
    # the rerun asked only for the ids without committed output, error rows included (Ray
    # drops a file whose write was not committed, so a few ids of `before` may be asked again)
    asked_again = attempts(base) - asked_first
    assert ROWS - len(before) <= asked_again < ROWS, (asked_again, len(before))
    answers = pq.read_table(out, columns=["id", "answer"]).to_pydict()
    assert any(a and a.startswith("answer to Item ") for a in answers["answer"]), answers["answer"][:5]
