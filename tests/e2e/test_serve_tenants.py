"""A real `llmbatch serve` on loopback with two keys, driven by the official openai SDK (issue
32): neither tenant can list, read, delete, use, retrieve or cancel the other's objects; a
second server on the same data dir is refused; a 300 MB upload over a 1 MiB limit and a
150 MB JSON body are refused without the server writing or holding them. No batch runs
(`--max-running 0`: batches queue), so no engine starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from inproc import llmbatch
from waiting import wait_for

pytestmark = pytest.mark.e2e

KEY_A = "sk-e2e-tenant-a-0123456789abcdef"
KEY_B = "sk-e2e-tenant-b-0123456789abcdef"
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(data_dir: Path, port: int, key_file: Path) -> list[str]:
    return [sys.executable, "-m", "llmbatch", "serve", "--model", "smollm2-135m-instruct", "--data-dir", str(data_dir),
            "--port", str(port), "--api-key-file", str(key_file), "--max-running", "0",
            "--max-file-bytes", str(MiB), "--log-level", "warning"]


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    key_file = root / "keys"
    key_file.write_text(f"# two teams\n{KEY_A}\n{KEY_B}\n")
    spool = root / "tmp"
    spool.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "LLMBATCH_API_KEYS"}
    env["TMPDIR"] = str(spool)  # where a spooling server would put an upload
    port = free_port()
    with open(root / "server.log", "ab") as log:
        proc = subprocess.Popen(serve_cmd(root / "data", port, key_file), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: listening(port), 180, "the server listens", proc, step=0.2)
        yield {"proc": proc, "port": port, "root": root, "key_file": key_file, "spool": spool, "env": env}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def client(server, key: str):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key=key, max_retries=0)


def batch_lines(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "smollm2-135m-instruct", "max_tokens": 4,
                                        "messages": [{"role": "user", "content": f"{i}"}]}}) + "\n"
                   for i in range(n)).encode()


def test_neither_tenant_reaches_the_others_files_or_batches(server):
    import openai

    a, b = client(server, KEY_A), client(server, KEY_B)
    mine = {}
    for name, sdk in (("a", a), ("b", b)):
        uploaded = sdk.files.create(file=(f"{name}.jsonl", batch_lines(2)), purpose="batch")
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        spare = sdk.files.create(file=(f"{name}-spare.jsonl", batch_lines(1)), purpose="batch")
        mine[name] = (uploaded, batch, spare)
    for me, other, sdk in (("a", "b", a), ("b", "a", b)):
        theirs_file, theirs_batch, theirs_spare = mine[other]
        assert {f.id for f in sdk.files.list()} == {mine[me][0].id, mine[me][2].id}
        assert [x.id for x in sdk.batches.list()] == [mine[me][1].id]
        for call in (lambda: sdk.files.retrieve(theirs_file.id), lambda: sdk.files.content(theirs_file.id),
                     lambda: sdk.files.delete(theirs_spare.id), lambda: sdk.batches.retrieve(theirs_batch.id),
                     lambda: sdk.batches.cancel(theirs_batch.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        with pytest.raises(openai.BadRequestError, match="No such File"):
            sdk.batches.create(input_file_id=theirs_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    for name, sdk in (("a", a), ("b", b)):  # nothing of theirs moved
        uploaded, batch, spare = mine[name]
        assert sdk.files.retrieve(spare.id).id == spare.id
        assert sdk.batches.retrieve(batch.id).status in ("validating", "in_progress")
        assert sdk.files.content(uploaded.id).content == batch_lines(2)
    cancelled = a.batches.cancel(mine["a"][1].id)  # its owner can: queued, it never ran
    wait_for(lambda: a.batches.retrieve(cancelled.id).status == "cancelled", 30, "the batch is cancelled")
    done = a.batches.retrieve(cancelled.id)
    errors = [json.loads(x) for x in a.files.content(done.error_file_id).text.splitlines()]
    assert sorted((e["custom_id"], e["error"]["code"]) for e in errors) == [("req-0", "batch_cancelled"),
                                                                          ("req-1", "batch_cancelled")]
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(done.error_file_id)
    database = (server["root"] / "data" / "llmbatch.db").read_bytes()
    assert KEY_A.encode() not in database and KEY_B.encode() not in database


def test_a_second_server_on_the_same_data_dir_is_refused(server, monkeypatch):
    """The second server runs in the test process (tests/inproc.py: another process than the
    first's, which is what the data dir's lock must see; no process of its own to start). It is
    given the first one's port: a second server that the data dir did not refuse fails to listen
    there (without the message asserted) instead of serving in the test process for ever."""
    monkeypatch.delenv("LLMBATCH_API_KEYS", raising=False)
    args = serve_cmd(server["root"] / "data", server["port"], server["key_file"])[3:]  # past `python -m llmbatch`
    second = llmbatch(*args, env={"TMPDIR": server["env"]["TMPDIR"]})
    assert second.returncode != 0
    assert "another llmbatch serve" in second.stdout + second.stderr


def _tree_bytes(*roots: Path) -> int:
    total = 0
    for root in roots:
        for folder, _, files in os.walk(root):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(folder, name))
                except FileNotFoundError:
                    pass
    return total


def _memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def _stream(url: str, headers: dict[str, str], chunks) -> int | None:
    """POST ``chunks``; the status, or None when the server closed the connection while the
    body was still being sent (it refused it without reading it)."""
    try:
        response = httpx.post(url, headers=headers, content=chunks, timeout=httpx.Timeout(60))
    except httpx.TransportError:
        return None
    return response.status_code


def test_a_300_mb_upload_and_a_150_mb_json_body_are_refused_without_being_held(server):
    base = f"http://127.0.0.1:{server['port']}/v1"
    pid = server["proc"].pid
    watched = (server["spool"], server["root"] / "data")
    before = _tree_bytes(*watched)
    peak = 0
    boundary = "llmbatchboundary"
    block = batch_lines(1) * (MiB // len(batch_lines(1)))

    def upload():
        nonlocal peak
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\n"
               "Content-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n\r\n").encode()
        for _ in range(300):
            peak = max(peak, _tree_bytes(*watched) - before)
            yield block
        yield f"\r\n--{boundary}--\r\n".encode()

    status = _stream(f"{base}/files", {"Authorization": f"Bearer {KEY_A}",
                                       "Content-Type": f"multipart/form-data; boundary={boundary}"}, upload())
    assert status in (413, None)
    peak = max(peak, _tree_bytes(*watched) - before)
    print(f"300 MB upload over a 1 MiB limit: status {status}, at most {peak / MiB:.2f} MiB written")
    assert peak <= 4 * MiB, f"{peak / MiB:.0f} MiB written for a 300 MB upload over a 1 MiB limit"

    rss_before = _memory_kib(pid, "VmRSS")

    def body():
        yield b'{"input_file_id": "'
        for _ in range(150):
            yield b"a" * MiB
        yield b'", "endpoint": "/v1/chat/completions", "completion_window": "24h"}'

    status = _stream(f"{base}/batches", {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"},
                     body())
    assert status in (413, None)
    grown = _memory_kib(pid, "VmHWM") - rss_before
    print(f"150 MB JSON body: status {status}, peak RSS {grown / 1024:+.1f} MB over the RSS before")
    assert grown < 50 * 1024, f"the server's peak memory grew by {grown / 1024:.0f} MB for a 150 MB JSON body"
    assert client(server, KEY_A).models.list().data  # and it still answers
