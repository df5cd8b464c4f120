"""`llmbatch serve` on loopback, driven by the official openai SDK, on the real engine: a batch
completes; an invalid file fails with line-numbered errors; cancel keeps what was done; a
wrong key gets 401; a server SIGKILLed mid-batch and started again finishes the batch with
every custom_id exactly once, without recomputing the rows it had finished."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from llmbatch.jobs.store import JobDir

pytestmark = pytest.mark.e2e

KEY = "sk-e2e-secret-key-0123456789"
SETTINGS = ["--set", "model.engine_kwargs.max_model_len=512",  # the suite's usual engine (a warm one)
            "--set", "model.batch_size=4", "--set", "model.max_concurrent_batches=1", "--set", "commit_seconds=0.5"]
FINAL = ("completed", "failed", "cancelled", "expired")


class Server:
    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "LLMBATCH_API_KEYS": KEY}
        log = open(self.data_dir.parent / "server.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "llmbatch", "serve", "--model", "smollm2-135m-instruct",
                                      "--data-dir", str(self.data_dir), "--port", str(self.port), *SETTINGS],
                                     stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                assert self.proc.poll() is None, "the server exited at start-up"
                time.sleep(0.3)
        raise AssertionError("the server did not start")

    def client(self, key: str = KEY):
        from openai import OpenAI

        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=90)


@pytest.fixture(scope="module")
def server(ray_cluster, smollm2, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve") / "data")
    srv.start()
    yield srv
    srv.stop()


def batch_file(tmp_path: Path, n: int, max_tokens: int = 4, name: str = "in.jsonl") -> Path:
    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "temperature": 0,
                                  "ignore_eos": True,
                                  "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]}})
             for i in range(n)]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def create(client, path: Path):
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait(client, batch_id: str, until, timeout: float = 900):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert batch.status not in FINAL or until(batch), f"batch ended {batch.status}: {batch.errors}"
        time.sleep(0.3)
    raise AssertionError(f"timed out; batch is {batch.status} {batch.request_counts}")


def download(client, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


def test_wrong_key_gets_401_and_invalid_file_fails_with_line_numbers(server, tmp_path):
    import openai

    with pytest.raises(openai.AuthenticationError) as info:
        server.client("sk-wrong").batches.list()
    assert info.value.status_code == 401
    client = server.client()
    path = batch_file(tmp_path, 3)
    path.write_text(path.read_text() + "not json\n" + path.read_text().splitlines()[0] + "\n")
    batch = wait(client, create(client, path).id, lambda b: b.status in FINAL, timeout=60)
    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [(4, "invalid_json"), (5, "duplicate_custom_id")]


def test_upload_create_poll_download_exactly_once(server, tmp_path):
    from openai.types.chat import ChatCompletion

    client = server.client()
    batch = wait(client, create(client, batch_file(tmp_path, 6)).id, lambda b: b.status in FINAL)
    assert batch.status == "completed" and batch.request_counts.completed == 6 and batch.usage.output_tokens == 24
    lines = download(client, batch.output_file_id) + download(client, batch.error_file_id)
    assert sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(6))
    for line in lines:
        ChatCompletion.model_validate(line["response"]["body"])
    assert batch.id in [b.id for b in client.batches.list(limit=100)]
    job_files = "".join(p.read_text(errors="replace") for p in (server.data_dir / "batches").rglob("*")
                        if p.is_file() and p.suffix in (".json", ".yaml", ".txt", ".log", ".jsonl"))
    assert KEY not in job_files  # no key in any batch's job directory, job file or log


def test_cancel_stops_a_running_batch_and_keeps_what_was_done(server, tmp_path):
    client = server.client()
    batch = create(client, batch_file(tmp_path, 40, max_tokens=48))
    wait(client, batch.id, lambda b: b.request_counts.completed >= 4)
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch = wait(client, batch.id, lambda b: b.status in FINAL)
    assert batch.status == "cancelled" and batch.cancelled_at
    done, errors = download(client, batch.output_file_id), download(client, batch.error_file_id)
    assert 4 <= len(done) < 40
    assert sorted(x["custom_id"] for x in done + errors) == sorted(f"req-{i}" for i in range(40))
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def _parts(job: JobDir) -> dict[str, set[int]]:
    return {p.name: set(pq.read_table(p, columns=["__llmbatch_id"]).column(0).to_pylist()) for p in job.part_files()}


def test_sigkill_mid_batch_then_restart_finishes_exactly_once_without_recomputing(server, tmp_path):
    client = server.client()
    batch = create(client, batch_file(tmp_path, 40, max_tokens=32))
    wait(client, batch.id, lambda b: b.request_counts.completed >= 8)
    server.stop(signal.SIGKILL)
    job = JobDir(server.data_dir / "batches" / batch.id / "job")
    deadline = time.monotonic() + 90
    while job.is_running() and time.monotonic() < deadline:  # the job process stops with its server
        time.sleep(0.3)
    assert not job.is_running()
    before = _parts(job)
    finished_before = set().union(*before.values())
    assert 8 <= len(finished_before) < 40
    server.start()
    batch = wait(client, batch.id, lambda b: b.status in FINAL)
    assert batch.status == "completed" and batch.request_counts.completed == 40
    lines = download(client, batch.output_file_id) + download(client, batch.error_file_id)
    assert sorted(x["custom_id"] for x in lines) == sorted(f"req-{i}" for i in range(40))
    after = _parts(job)
    assert all(after[name] == ids for name, ids in before.items())  # committed parts kept as they were
    new_rows = [i for name, ids in after.items() if name not in before for i in ids]
    assert not set(new_rows) & finished_before and len(new_rows) == len(set(new_rows)) == 40 - len(finished_before)
