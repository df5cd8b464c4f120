"""The Batch API server without an engine: auth, files, limits, validation, listing, cancel,
migrations and the start-up checks. (tests/e2e/test_openai_server.py runs batches for real.)"""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from llmbatch.errors import ConfigError
from llmbatch.server.main import job_template, probe
from llmbatch.server.runner import BatchRunner
from llmbatch.server.settings import ServerSettings, check, load_api_keys

KEY = "sk-unit-test-key-0123456789"
CHAT = "/v1/chat/completions"


def request_line(custom_id: str, **body) -> str:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


@pytest.fixture
def server(tmp_path, monkeypatch):
    """The app with its runner; jobs are never started (batches stay queued)."""
    from llmbatch.server.app import create_app
    from llmbatch.server.db import Database
    from llmbatch.server.storage import FileStore

    monkeypatch.setattr(BatchRunner, "_launch", lambda self, batch: None)
    settings = ServerSettings(data_dir=tmp_path, model="smollm2-135m-instruct", api_keys=frozenset({KEY}),
                              max_file_bytes=4096, max_lines=5, poll_s=0.05)
    template = job_template(settings)
    endpoints, options = probe(settings, template)
    db = Database(settings.db_url)
    store = FileStore(settings.files_root)
    app = create_app(settings, db, store, BatchRunner(settings, db, store, template, options), endpoints,
                     options.models)
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client, db
    db.close()


def upload(client, text: str, purpose: str = "batch"):
    return client.post("/v1/files", files={"file": ("in.jsonl", text.encode())}, data={"purpose": purpose})


def wait_status(client, batch_id: str, statuses: tuple[str, ...], timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in statuses:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} stayed {batch['status']}")


def test_a_wrong_or_missing_key_gets_401(server):
    client, _ = server
    for headers in ({"Authorization": "Bearer nope"}, {"Authorization": ""}, {"Authorization": "Basic " + KEY}):
        response = client.get("/v1/files", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert KEY not in response.text
    assert client.get("/health", headers={"Authorization": ""}).status_code == 200


def test_files_upload_list_retrieve_content_delete_and_limits(server):
    client, _ = server
    text = "\n".join(request_line(f"r{i}") for i in range(2)) + "\n"
    created = upload(client, text).json()
    assert (created["object"], created["purpose"], created["bytes"]) == ("file", "batch", len(text))
    assert client.get(f"/v1/files/{created['id']}").json()["filename"] == "in.jsonl"
    assert client.get(f"/v1/files/{created['id']}/content").text == text
    second = upload(client, text).json()
    page = client.get("/v1/files", params={"limit": 1}).json()
    assert [f["id"] for f in page["data"]] == [second["id"]] and page["has_more"]
    page = client.get("/v1/files", params={"limit": 1, "after": second["id"]}).json()
    assert [f["id"] for f in page["data"]] == [created["id"]] and not page["has_more"]
    assert client.delete(f"/v1/files/{second['id']}").json() == {"id": second["id"], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{second['id']}").status_code == 404
    assert upload(client, "x" * 5000).status_code == 413
    assert upload(client, "\n" * 6).json()["error"]["code"] == "too_many_lines"
    assert upload(client, text, purpose="fine-tune").status_code == 400


def test_an_invalid_file_fails_with_line_numbered_errors(server):
    client, _ = server
    text = "\n".join([request_line("a"), request_line("a"), "{", request_line("b", model="gpt-4o", n=2)]) + "\n"
    file_id = upload(client, text).json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT,
                                             "completion_window": "24h"}).json()
    assert batch["status"] == "validating" and batch["object"] == "batch"
    batch = wait_status(client, batch["id"], ("failed",))
    assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == [
        (2, "duplicate_custom_id"), (3, "invalid_json"), (4, "model_not_found")]
    assert batch["failed_at"] and batch["request_counts"]["total"] == 4


def test_create_checks_endpoint_window_metadata_and_file(server):
    client, _ = server
    file_id = upload(client, request_line("a") + "\n").json()["id"]
    bad = [({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "soon"}, "completion_window"),
           ({"metadata": {"k" * 65: "v"}}, "metadata"), ({"input_file_id": "file-nope"}, "input_file_id")]
    for change, param in bad:
        body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **change}
        response = client.post("/v1/batches", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_queued_batch_cancels_lists_and_its_file_cannot_be_deleted_meanwhile(server):
    client, _ = server
    file_id = upload(client, "\n".join(request_line(f"r{i}") for i in range(3)) + "\n").json()["id"]
    ids = [client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h",
                                            "metadata": {"n": str(i)}}).json()["id"] for i in range(3)]
    batch = wait_status(client, ids[0], ("in_progress",))
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0} and batch["in_progress_at"]
    assert client.delete(f"/v1/files/{file_id}").status_code == 409
    page = client.get("/v1/batches", params={"limit": 2}).json()
    assert [b["id"] for b in page["data"]] == ids[:0:-1] and page["has_more"]
    assert [b["id"] for b in client.get("/v1/batches", params={"after": ids[1]}).json()["data"]] == [ids[0]]
    for batch_id in ids:
        assert client.post(f"/v1/batches/{batch_id}/cancel").json()["status"] in ("cancelling", "cancelled")
    for batch_id in ids:
        done = wait_status(client, batch_id, ("cancelled",))
        assert done["cancelled_at"] and done["output_file_id"] is None
    assert client.post(f"/v1/batches/{ids[0]}/cancel").json()["status"] == "cancelled"
    assert client.delete(f"/v1/files/{file_id}").status_code == 200


def test_database_is_migrated_with_alembic(tmp_path):
    from llmbatch.server.db import Database

    db = Database(f"sqlite:///{tmp_path / 'x.db'}")
    assert db.revision == "0003"
    assert Database(f"sqlite:///{tmp_path / 'x.db'}").revision == "0003"  # a second start changes nothing


def test_start_up_refuses_no_key_and_open_no_auth(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMBATCH_API_KEYS", raising=False)
    base = dict(data_dir=tmp_path, model="smollm2-135m-instruct")
    with pytest.raises(ConfigError, match="no API key"):
        check(ServerSettings(**base))
    with pytest.raises(ConfigError, match="loopback"):
        check(ServerSettings(**base, no_auth=True, host="0.0.0.0"))
    check(ServerSettings(**base, no_auth=True, host="::1"))
    k = [f"sk-key-{i}-0123456789abcdef" for i in range(4)]
    (tmp_path / "keys").write_text(f"# team keys\n{k[0]}\n\n{k[1]}  # ci\n")
    assert set(load_api_keys(tmp_path / "keys", {"LLMBATCH_API_KEYS": f"{k[2]}, {k[3]}"})) == set(k)
    with pytest.raises(ConfigError, match="decided per batch"):
        job_template(ServerSettings(**base, overrides=["output.path=x"]))
