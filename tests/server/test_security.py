"""The server as its users' security reviewer reads it (issue 32): keys are tenants, request
bodies are bounded while they stream in, files expire, stopped jobs are stopped (process
group, SIGKILL after a grace), one server per data dir, key files, --no-auth, TLS. The app is
real; the runner is driven by hand (``tick``) and never starts a job unless a test says so."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from llmbatch.errors import ConfigError
from llmbatch.server import runner as runner_module
from llmbatch.server.main import job_template, probe
from llmbatch.server.runner import BatchRunner
from llmbatch.server.settings import ServerSettings, load_api_keys

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"
CHAT = "/v1/chat/completions"
MiB = 1 << 20


def request_line(custom_id: str) -> str:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


BATCH_FILE = "".join(request_line(f"r{i}") + "\n" for i in range(3))


@dataclass
class Served:
    app: Any
    db: Any
    runner: BatchRunner
    settings: ServerSettings

    def client(self, key: str | None = KEY_A, **kwargs) -> TestClient:
        """A client of the app (its lifespan is not run: the runner moves only when a test ticks it)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return TestClient(self.app, headers=headers, **kwargs)

    def tick(self) -> None:
        """One runner step, waiting for the validations it starts to end first."""
        self.runner.tick()
        for future in list(self.runner.validating.values()):
            future.result(timeout=30)
        self.runner.tick()


@pytest.fixture
def make(tmp_path, monkeypatch):
    from llmbatch.server.app import create_app
    from llmbatch.server.db import Database
    from llmbatch.server.storage import FileStore

    built = []

    def build(**overrides) -> Served:
        fields = dict(data_dir=tmp_path / "data", model="smollm2-135m-instruct", max_file_bytes=4096, max_lines=5,
                      poll_s=0.05, api_keys=frozenset({KEY_A, KEY_B}))
        fields.update(overrides)
        settings = ServerSettings(**fields)
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        template = job_template(settings)
        endpoints, options = probe(settings, template)
        db = Database(settings.db_url)
        store = FileStore(settings.files_root)
        runner = BatchRunner(settings, db, store, template, options)
        settings.batches_dir.mkdir(parents=True, exist_ok=True)
        built.append(db)
        return Served(create_app(settings, db, store, runner, endpoints, options.models), db, runner, settings)

    yield build
    for db in built:
        db.close()


def upload(client: TestClient, text: str = BATCH_FILE, **data) -> httpx.Response:
    return client.post("/v1/files", files={"file": ("in.jsonl", text.encode())}, data={"purpose": "batch", **data})


def create(client: TestClient, file_id: str, **body) -> httpx.Response:
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h",
                                            **body})


# -- H1: tenants --------------------------------------------------------------------------------

def test_a_key_sees_uses_and_cancels_only_its_own_files_and_batches(make):
    served = make()
    a, b = served.client(KEY_A), served.client(KEY_B)
    file_id = upload(a).json()["id"]
    batch_id = create(a, file_id).json()["id"]
    assert b.get("/v1/files").json()["data"] == [] and b.get("/v1/batches").json()["data"] == []
    assert b.get("/v1/files", params={"after": file_id}).json()["data"] == []
    for method, path in (("get", f"/v1/files/{file_id}"), ("get", f"/v1/files/{file_id}/content"),
                         ("delete", f"/v1/files/{file_id}"), ("get", f"/v1/batches/{batch_id}"),
                         ("post", f"/v1/batches/{batch_id}/cancel")):
        response = getattr(b, method)(path)
        assert response.status_code == 404, (method, path, response.text)
    used = create(b, file_id)
    assert used.status_code == 400 and used.json()["error"]["code"] == "file_not_found"
    assert [f["id"] for f in a.get("/v1/files").json()["data"]] == [file_id]
    assert a.get(f"/v1/batches/{batch_id}").json()["status"] == "validating"  # not cancelled by b
    assert a.get(f"/v1/files/{file_id}/content").text == BATCH_FILE
    database = (served.settings.data_dir / "llmbatch.db").read_bytes()
    assert KEY_A.encode() not in database and KEY_B.encode() not in database  # a digest, never the key


def test_a_key_file_names_projects_whose_keys_share_files(make, tmp_path):
    third = "sk-tenant-c-0123456789abcdef"
    key_file = tmp_path / "keys"
    key_file.write_text(f"# team keys\n{KEY_A} search\n{KEY_B}   search  # ci\n{third}\n")
    keys = load_api_keys(key_file, {})
    served = make(api_keys=keys)
    file_id = upload(served.client(KEY_A)).json()["id"]
    assert served.client(KEY_B).get(f"/v1/files/{file_id}").status_code == 200
    assert served.client(third).get(f"/v1/files/{file_id}").status_code == 404


def test_quotas_per_tenant_answer_429_with_what_to_do(make):
    served = make(tenant_bytes=2 * len(BATCH_FILE), tenant_batches=1)
    a, b = served.client(KEY_A), served.client(KEY_B)
    file_id = upload(a).json()["id"]
    assert upload(a).status_code == 200
    refused = upload(a)
    assert refused.status_code == 429 and "--tenant-bytes" in refused.json()["error"]["message"]
    assert upload(b).status_code == 200  # another tenant's room is its own
    assert create(a, file_id).status_code == 200
    refused = create(a, file_id)
    assert refused.status_code == 429 and "--tenant-batches" in refused.json()["error"]["message"]
    partial = served.client(KEY_B)
    big = "x" * (len(BATCH_FILE) + 10)  # more than b's room, less than --max-file-bytes
    assert upload(partial, big).status_code == 429
    assert len(b.get("/v1/files").json()["data"]) == 1


# -- M1: bounded bodies, expiry, completion_window ----------------------------------------------

def _tree_bytes(*roots: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for root in roots for d, _, fs in os.walk(root) for f in fs
               if os.path.exists(os.path.join(d, f)))


def _send(app, method: str, path: str, headers: dict[str, str], chunks) -> tuple[int, int]:
    """Stream ``chunks`` to the app (ASGI, in process) as a request body; returns the status
    and how many bytes the app took before it answered."""
    taken = 0

    async def body():
        nonlocal taken
        for chunk in chunks:
            taken += len(chunk)
            yield chunk

    async def go() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            response = await client.request(method, path, headers=headers, content=body())
            return response.status_code

    return asyncio.run(go()), taken


def test_a_300_mb_upload_over_a_1_mib_limit_stops_at_the_limit(make, tmp_path, monkeypatch):
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))  # where a spooling server would write
    served = make(max_file_bytes=MiB, max_lines=10**9)
    watched = (spool, served.settings.data_dir)
    before = _tree_bytes(*watched)
    peak = 0
    boundary = "llmbatchboundary"
    line = (request_line("x") + "\n").encode()
    block = line * (MiB // len(line))

    def chunks():
        nonlocal peak
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\n"
               f"Content-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
               f"Content-Type: application/jsonl\r\n\r\n").encode()
        for _ in range(300):
            peak = max(peak, _tree_bytes(*watched) - before)
            yield block
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": f"multipart/form-data; boundary={boundary}"}
    status, taken = _send(served.app, "POST", "/v1/files", headers, chunks())
    assert status == 413
    assert taken <= 3 * MiB, f"the server read {taken / MiB:.0f} MiB of a 300 MiB upload over a 1 MiB limit"
    assert peak <= 3 * MiB, f"{peak / MiB:.0f} MiB were written while the upload came in"
    assert _tree_bytes(*watched) - before < MiB  # and nothing is left
    assert served.client().get("/v1/files").json()["data"] == []


def test_a_150_mb_json_body_is_refused_after_its_first_mebibyte(make):
    served = make()

    def chunks():
        yield b'{"input_file_id": "'
        for _ in range(150):
            yield b"a" * MiB
        yield b'", "endpoint": "/v1/chat/completions"}'

    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    status, taken = _send(served.app, "POST", "/v1/batches", headers, chunks())
    assert status == 413
    assert taken <= 2 * MiB, f"the server read {taken / MiB:.0f} MiB of a 150 MiB JSON body"  # so its memory too
    declared = served.client().post("/v1/batches", content=b"{}", headers={"Content-Length": str(150 * MiB)})
    assert declared.status_code == 413


def test_completion_window_is_24h_or_a_bounded_longer_window(make):
    served = make(max_window_s=7 * 86400)
    client = served.client()
    file_id = upload(client).json()["id"]
    for window in ("1m", "90m", "23h", "8d", "9" * 40 + "h", "24 h", "0d"):
        response = create(client, file_id, completion_window=window)
        assert response.status_code == 400, window
        assert response.json()["error"]["param"] == "completion_window"
    for window, seconds in (("24h", 86400), ("48h", 2 * 86400), ("7d", 7 * 86400)):
        batch = create(client, file_id, completion_window=window).json()
        assert batch["expires_at"] - batch["created_at"] == seconds


def test_files_expire_as_asked_and_the_sweeper_deletes_them(make):
    served = make()
    client = served.client()
    kept = upload(client).json()
    leaving = upload(client, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}).json()
    assert kept["expires_at"] is None and leaving["expires_at"] == leaving["created_at"] + 3600
    bad = upload(client, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "10"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "expires_after"
    assert create(client, kept["id"], output_expires_after={"anchor": "created_at", "seconds": 5}).status_code == 400
    batch = create(client, kept["id"], output_expires_after={"anchor": "created_at", "seconds": 7200}).json()
    assert served.db.get(served.db.batches, batch["id"])["output_expires_s"] == 7200
    served.runner.sweep(leaving["expires_at"])
    assert client.get(f"/v1/files/{leaving['id']}").status_code == 404
    assert not (served.settings.data_dir / "files" / leaving["id"]).exists()
    assert client.get(f"/v1/files/{kept['id']}").status_code == 200


def test_content_of_a_file_gone_from_the_store_is_a_404_and_crash_litter_is_swept(make, tmp_path, monkeypatch):
    served = make()
    client = served.client()
    file_id = upload(client).json()["id"]
    (served.settings.data_dir / "files" / file_id).unlink()  # deleted or expired meanwhile
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 404 and response.json()["error"]["code"] == "file_not_found"
    from llmbatch.server import main

    monkeypatch.setattr(main.uvicorn, "run", lambda app, **kwargs: None)
    litter = tmp_path / "data" / "files" / "file-crashed.tmp"
    litter.write_bytes(b"half an upload")
    main.serve(ServerSettings(data_dir=tmp_path / "data", model="smollm2-135m-instruct",
                              api_keys=frozenset({KEY_A})))
    assert not litter.exists()


# -- M2 and the Low items about stopping --------------------------------------------------------

STUBBORN = """
import signal, subprocess, sys, time
mode = signal.SIG_IGN if sys.argv[1] == "1" else signal.SIG_DFL
signal.signal(signal.SIGTERM, mode)
child = subprocess.Popen([sys.executable, "-c", "import signal, time\\n"
                          f"signal.signal(signal.SIGTERM, signal.{mode.name})\\n"
                          "print('ready', flush=True)\\ntime.sleep(600)"], stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
child.wait()
"""


def _job_group(ignore_term: bool) -> tuple[subprocess.Popen, int]:
    """A job process leading its own group with a child; with ``ignore_term`` both ignore SIGTERM."""
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN, "1" if ignore_term else "0"], stdout=subprocess.PIPE,
                            start_new_session=True)
    return proc, int(proc.stdout.readline())


def _ends(pid: int, timeout: float = 20) -> bool:
    """Whether process ``pid`` (not our child) ends within ``timeout`` seconds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # already gone (and reaped)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(fd)


def _queued_batch(served: Served, client: TestClient) -> str:
    file_id = upload(client).json()["id"]
    batch_id = create(client, file_id).json()["id"]
    served.db.transition(batch_id, None, status="in_progress", in_progress_at=int(time.time()), total=3)
    return batch_id


def test_cancel_sigkills_a_job_group_that_ignores_sigterm_and_writes_the_error_file(make):
    served = make(stop_grace_s=0)
    client = served.client()
    batch_id = _queued_batch(served, client)
    proc, child = _job_group(ignore_term=True)
    try:
        served.runner.procs[batch_id] = proc
        assert client.post(f"/v1/batches/{batch_id}/cancel").json()["status"] == "cancelling"
        served.runner.tick()  # SIGTERM: ignored
        served.runner.tick()  # the grace (0 s) is over: SIGKILL to the group
        assert proc.wait(timeout=20) == -signal.SIGKILL
        assert _ends(child), "the job's child outlived the cancel"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    served.runner.tick()
    batch = client.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "cancelled" and batch["error_file_id"]
    lines = [json.loads(x) for x in client.get(f"/v1/files/{batch['error_file_id']}/content").text.splitlines()]
    assert [(x["custom_id"], x["error"]["code"]) for x in lines] == [(f"r{i}", "batch_cancelled") for i in range(3)]


def test_shutdown_signals_the_job_process_group(make):
    served = make()
    proc, child = _job_group(ignore_term=False)
    try:
        served.runner.procs["batch_x"] = proc
        served.runner.start()
        served.runner.stop(timeout=20)
        assert proc.returncode is not None
        assert _ends(child), "the job's child outlived the server"
    finally:
        for pid in (proc.pid,):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


@pytest.mark.parametrize("stop", ["cancel", "expire"])
def test_a_batch_stopped_before_it_ran_gets_an_error_line_per_request(make, stop):
    served = make()
    client = served.client()
    file_id = upload(client).json()["id"]
    batch_id = create(client, file_id).json()["id"]  # still validating
    if stop == "cancel":
        client.post(f"/v1/batches/{batch_id}/cancel")
    else:
        served.db.transition(batch_id, None, expires_at=int(time.time()) - 1)
    served.tick()
    batch = client.get(f"/v1/batches/{batch_id}").json()
    code = {"cancel": "batch_cancelled", "expire": "batch_expired"}[stop]
    assert batch["status"] == {"cancel": "cancelled", "expire": "expired"}[stop]
    assert batch["output_file_id"] is None and batch["error_file_id"]
    lines = [json.loads(x) for x in client.get(f"/v1/files/{batch['error_file_id']}/content").text.splitlines()]
    assert [(x["custom_id"], x["error"]["code"], x["response"]) for x in lines] == [
        (f"r{i}", code, None) for i in range(3)]
    assert client.get(f"/v1/files/{batch['error_file_id']}").json()["purpose"] == "batch_output"
    assert served.client(KEY_B).get(f"/v1/files/{batch['error_file_id']}").status_code == 404  # the batch's tenant's


def test_the_runner_never_launches_a_batch_cancelled_a_moment_earlier(make, monkeypatch):
    served = make()
    client = served.client()
    batch_id = _queued_batch(served, client)
    seen = served.db.get(served.db.batches, batch_id)  # what the runner's step read
    assert client.post(f"/v1/batches/{batch_id}/cancel").json()["status"] == "cancelling"
    started = []
    monkeypatch.setattr(runner_module.subprocess, "Popen", lambda *a, **k: started.append(a))
    served.runner._in_progress(seen, int(time.time()))
    assert started == [] and batch_id not in served.runner.procs


def test_a_failed_job_shows_clients_its_redacted_error_never_the_log(make):
    served = make()
    folder = served.runner.batch_dir("batch_x")
    folder.mkdir(parents=True)
    log = folder / "driver.log"
    log.write_text("loading /srv/secret/model with token hf_abcdefghijklmnopqrstuvwxyz012345\nTraceback ...\n")
    told = served.runner._log_tail("batch_x")
    assert "hf_abc" not in told and "/srv/secret" not in told and "Traceback" not in told
    log.write_text(log.read_text() + "error: JobError: the endpoint said no (Authorization: Bearer sk-live-abcdef123456)\n")
    told = served.runner._log_tail("batch_x")
    assert told.startswith("error: JobError: the endpoint said no") and "sk-live-abcdef123456" not in told


# -- M3: one server per data dir ----------------------------------------------------------------

def test_a_second_server_on_the_same_data_dir_is_refused(tmp_path):
    from llmbatch.server.main import hold_data_dir

    first = hold_data_dir(tmp_path)
    try:
        with pytest.raises(ConfigError, match=f"another llmbatch serve \\(pid {os.getpid()}.*data dir"):
            hold_data_dir(tmp_path)
    finally:
        os.close(first)
    os.close(hold_data_dir(tmp_path))  # free again once the first is gone


def test_a_second_server_on_the_same_database_is_refused_while_the_first_holds_its_lease(tmp_path, monkeypatch):
    from llmbatch.server import main
    from llmbatch.server.db import Database

    url = f"sqlite:///{tmp_path / 'shared.db'}"
    first = Database(url)
    assert first.claim_lease("server one", 60, now=time.time()) is None
    assert first.claim_lease("server one", 60, now=time.time()) is None  # renewed
    monkeypatch.setattr(main.uvicorn, "run", lambda app, **kwargs: None)
    settings = dict(model="smollm2-135m-instruct", api_keys=frozenset({KEY_A}), database_url=url)
    with pytest.raises(ConfigError, match="another llmbatch serve \\(server one\\) runs the batches of this database"):
        main.serve(ServerSettings(data_dir=tmp_path / "two", **settings))
    assert first.claim_lease("server one", 60, now=time.time() - 120) is None  # its last renewal: 2 minutes ago
    main.serve(ServerSettings(data_dir=tmp_path / "three", **settings))  # takes the stale lease
    assert first.claim_lease("server four", 60, now=time.time()) is None  # server three let it go when it stopped
    assert first.claim_lease("server one", 60, now=time.time()) == "server four"
    killed = f"{os.uname().nodename}:{(tmp_path / 'five').resolve()} pid 1 feed"
    first.release_lease("server four")
    assert first.claim_lease(killed, 60, now=time.time()) is None  # a server SIGKILLed a moment ago
    main.serve(ServerSettings(data_dir=tmp_path / "five", **settings))  # its own data dir's: taken over
    first.close()


# -- M5 and the Low items about keys, --no-auth and TLS -----------------------------------------

def test_a_hash_inside_a_key_is_part_of_it_and_short_keys_are_refused(tmp_path):
    key = "sk-9f#Qz81kAbCdEfGhIjKlMnOp"
    (tmp_path / "keys").write_text(f"#comment\n  # indented comment\n{key}\n")
    assert set(load_api_keys(tmp_path / "keys", {})) == {key}
    (tmp_path / "short").write_text("sk-9f#Qz81k\n")
    with pytest.raises(ConfigError, match="line 1.*fewer than 20 characters"):
        load_api_keys(tmp_path / "short", {})
    with pytest.raises(ConfigError, match="LLMBATCH_API_KEYS.*fewer than 20"):
        load_api_keys(None, {"LLMBATCH_API_KEYS": "sk-short"})


def test_no_auth_answers_loopback_hosts_only_and_no_foreign_origin(make):
    served = make(api_keys=frozenset(), no_auth=True)
    assert served.client(None, base_url="http://localhost:8000").get("/v1/files").status_code == 200
    assert served.client(None, base_url="http://127.0.0.1:8000").get("/v1/models").status_code == 200
    assert served.client(None, base_url="http://[::1]:8000").get("/v1/models").status_code == 200
    rebound = served.client(None, base_url="http://attacker.example:8000").get("/v1/files")
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "forbidden_host"
    cross = served.client(None, base_url="http://localhost:8000").post(
        "/v1/files", headers={"Origin": "https://attacker.example"}, files={"file": ("a.jsonl", b"{}\n")},
        data={"purpose": "batch"})
    assert cross.status_code == 403 and cross.json()["error"]["code"] == "forbidden_origin"
    same = served.client(None, base_url="http://localhost:8000").get("/v1/files",
                                                                      headers={"Origin": "http://localhost:3000"})
    assert same.status_code == 200


def test_openapi_json_needs_a_key(make):
    served = make()
    assert served.client(None).get("/openapi.json").status_code == 401
    assert served.client(KEY_A).get("/openapi.json").json()["info"]["title"] == "llmbatch Batch API"
    assert served.client(None).get("/health").status_code == 200


def test_tls_files_reach_uvicorn_and_clear_keys_off_loopback_are_warned(tmp_path, monkeypatch, caplog):
    from llmbatch.server import main

    runs = []
    monkeypatch.setattr(main.uvicorn, "run", lambda app, **kwargs: runs.append(kwargs))
    base = dict(model="smollm2-135m-instruct", api_keys=frozenset({KEY_A}), host="0.0.0.0")
    with caplog.at_level(logging.WARNING, logger="llmbatch.server"):
        main.serve(ServerSettings(data_dir=tmp_path / "plain", **base))
    assert runs[-1]["ssl_certfile"] is None and "without TLS" in caplog.text
    caplog.clear()
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("cert")
    key.write_text("key")
    with caplog.at_level(logging.WARNING, logger="llmbatch.server"):
        main.serve(ServerSettings(data_dir=tmp_path / "tls", ssl_certfile=str(cert), ssl_keyfile=str(key), **base))
    assert (runs[-1]["ssl_certfile"], runs[-1]["ssl_keyfile"]) == (str(cert), str(key))
    assert "without TLS" not in caplog.text
    with pytest.raises(ConfigError, match="go together"):
        main.serve(ServerSettings(data_dir=tmp_path / "half", ssl_certfile=str(cert), **base))
