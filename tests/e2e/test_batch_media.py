"""The job `llmbatch serve` runs for a batch (an OpenAI batch file, multimodal stage on) on the
real engine with a tiny vision model: a line with its image as a data URL is answered; lines
naming a local file (a path, file://) or a loopback host (127.0.0.1, localhost, [::1]) are
error lines, and the loopback media servers see no request. (Redirects to loopback and the
rest of the policy: tests/io/test_media_policy.py.)"""

from __future__ import annotations

import base64
import http.server
import json
import socket
import threading

import pytest
import yaml
from inproc import llmbatch

pytestmark = pytest.mark.e2e

# the engine tests/e2e/test_multimodal.py uses (a warm one when both run in one session)
ENGINE = dict(max_model_len=512, kv_cache_memory_bytes=128 << 20, enforce_eager=True, dtype="float32",
              limit_mm_per_prompt={"image": 2})


class Recording(http.server.ThreadingHTTPServer):
    def __init__(self, host: str, family: int, body: bytes):
        self.address_family = family
        self.seen: list[str] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                seen.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        super().__init__((host, 0), Handler)
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()


def line(custom_id: str, url: str) -> str:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in the image?"}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"max_tokens": 4, "temperature": 0,
                                "messages": [{"role": "user", "content": content}]}})


def test_a_batch_reaches_no_local_file_and_no_loopback_host(ray_cluster, test_models, tmp_path):
    from llmbatch.sample_images import sample_images

    png = sample_images(1, seed=3)[0]["image"]
    secret = tmp_path / "secret.png"
    secret.write_bytes(png)
    v4 = Recording("127.0.0.1", socket.AF_INET, png)
    v6 = Recording("::1", socket.AF_INET6, png)
    port4, port6 = v4.server_address[1], v6.server_address[1]
    lines = {"data": "data:image/png;base64," + base64.b64encode(png).decode(), "path": str(secret),
             "file": f"file://{secret}", "ip": f"http://127.0.0.1:{port4}/a.png",
             "name": f"http://localhost:{port4}/a.png", "v6": f"http://[::1]:{port6}/a.png"}
    (tmp_path / "batch.jsonl").write_text("".join(line(k, u) + "\n" for k, u in lines.items()))
    job = {"input": {"path": "batch.jsonl", "format": "openai-batch", "invalid_lines": "error"},
           "model": {"source": test_models["tiny-vlm"], "engine_kwargs": ENGINE,
                     "batch_size": 8, "prepare_multimodal_stage": {"enabled": True, "fetch_timeout_s": 2,
                                                                   "fetch_retries": 0}},
           "output": {"path": "output.jsonl", "errors_path": "error.jsonl"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    try:
        done = llmbatch("run", str(tmp_path / "job.yaml"), "--quiet")
    finally:
        v4.shutdown()
        v6.shutdown()
    assert done.returncode == 0, done.stderr[-3000:]
    answered = {json.loads(x)["custom_id"] for x in (tmp_path / "output.jsonl").read_text().splitlines()}
    errors = {json.loads(x)["custom_id"]: json.loads(x)["error"]["message"]
              for x in (tmp_path / "error.jsonl").read_text().splitlines()}
    assert answered == {"data"} and set(errors) == set(lines) - {"data"}, errors
    for key in ("path", "file"):
        assert "local media files are not allowed" in errors[key] and str(secret) not in errors[key]
    for key in ("ip", "name", "v6"):
        assert "loopback, private, link-local or reserved" in errors[key], errors[key]
    assert v4.seen == [] and v6.seen == []
