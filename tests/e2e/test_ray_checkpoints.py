"""Ray Data's own checkpoints keep working with llmbatch's processor.

The seeds' checkpoint example (``tests/e2e/checkpoint_run.py``: 400 rows in 8 Parquet files ->
processor -> ``write_parquet``, ``DataContext.checkpoint_config`` with ``id_column="id"``) on a
2-CPU Ray, against the fake OpenAI-compatible server: SIGKILLed once some output files exist,
then run again; across both runs the written output holds every id exactly once (the rerun
skips what the first run wrote, and Ray drops the files of writes it had not committed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.e2e

ROWS = 400
FILES = 8
HERE = Path(__file__).parent


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before: {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {what}")


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


def written_ids(out: Path) -> list[int]:
    ids: list[int] = []
    for f in sorted(out.glob("*.parquet")):
        ids += pq.read_table(f, columns=["id"]).column("id").to_pylist()
    return ids


def test_a_killed_checkpointed_run_reruns_without_losing_or_repeating_an_id(server, tmp_path):
    import pandas as pd

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    df = pd.DataFrame({"id": range(ROWS), "name": [f"name {i}" for i in range(ROWS)]})
    for k in range(FILES):
        df.iloc[k * ROWS // FILES:(k + 1) * ROWS // FILES].to_parquet(inputs / f"part-{k}.parquet")
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    cmd = [sys.executable, str(HERE / "checkpoint_run.py"), "--url", server, "--inputs", str(inputs),
           "--out", str(out), "--checkpoint", str(checkpoint)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "run.log"

    first = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    wait_for(lambda: len(list(out.glob("*.parquet"))) >= 2, 180, "two output files", first)
    os.killpg(first.pid, signal.SIGKILL)  # the driver and the Ray it started
    first.wait(timeout=30)
    before = written_ids(out)
    assert 0 < len(before) < ROWS, len(before)
    assert len(before) == len(set(before)), "the first run wrote an id twice"

    base = server.removesuffix("/v1/chat/completions")
    urllib.request.urlopen(urllib.request.Request(f"{base}/reset", method="POST"), timeout=10).read()
    second = subprocess.run(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, timeout=300)
    assert second.returncode == 0, log.read_text()[-4000:]
    ids = written_ids(out)
    assert sorted(ids) == list(range(ROWS)), (len(ids), len(set(ids)))
    # the rerun asked only for the ids without committed output (Ray drops a file whose
    # write was not committed, so a few ids of `before` may be asked again)
    answered = json.loads(urllib.request.urlopen(f"{base}/stats", timeout=10).read())["answered"]
    assert ROWS - len(before) <= answered < ROWS, (answered, len(before))
    answers = pq.read_table(out, columns=["id", "answer"]).to_pydict()
    assert answers["answer"][0].startswith("answer to Item "), answers["answer"][0]
