"""Let no one in, and count honestly: one real job, read over HTTP from a server that wants
credentials, with secrets planted in every place a user can put one.

- no secret reaches the job directory or the terminal (job.json keeps ``${VAR}`` references
  and writes literal secrets as ``<redacted>``; a job with literal secrets resumes from its
  job file, and says so when resumed from the directory alone);
- the job directory holds no pickles (staged input and parts are Arrow columns);
- dedup follows its real rule on the real engine: greedy or seeded requests with n == 1 are
  answered once and copied; sampled ones, and seeded ones asking for n > 1, are not; stats count generated and delivered tokens
  apart.
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from inproc import llmbatch

pytestmark = pytest.mark.e2e

SECRETS = {
    "password": "pw-SECRET-1111",
    "signature": "sig-SECRET-2222",
    "hf_token": "hf_SECRET3333",
    "api_key": "sk-SECRET-4444",
    "engine_token": "hf_SECRET5555",
    "env_ref": "aws-SECRET-6666",
}

HOOKS = '''
def request(row):
    kind = row["kind"]
    params = {"max_tokens": 6}
    if kind == "greedy":
        params.update(temperature=0)
    elif kind == "seeded":
        params.update(temperature=0.9, seed=7)
    elif kind == "sampled":
        params.update(temperature=0.9)
    elif kind == "two":
        params.update(temperature=0.9, seed=7, n=2)
    return {"prompt": "Name one fruit:", "sampling_params": params}
'''
KINDS = ["greedy"] * 4 + ["seeded"] * 4 + ["sampled"] * 4 + ["two"] * 2


class AuthHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        expected = "Basic " + base64.b64encode(f"alice:{SECRETS['password']}".encode()).decode()
        if self.headers.get("Authorization") != expected:
            self.send_response(401)
            self.end_headers()
            return
        super().do_GET()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    lines = ["id,kind"] + [f"{i},{k}" for i, k in enumerate(KINDS)]
    (root / "rows.csv").write_text("\n".join(lines) + "\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(AuthHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def secret_job(ray_cluster, smollm2, served, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trust")
    (tmp / "hooks.py").write_text(HOOKS)
    url = (f"http://alice:{SECRETS['password']}@127.0.0.1:{served}/rows.csv"
           f"?X-Amz-Signature={SECRETS['signature']}")
    (tmp / "job.yaml").write_text(textwrap.dedent(f"""
        input: {{path: "{url}", format: csv, id_column: id}}
        model:
          source: smollm2-135m-instruct
          engine_kwargs: {{max_model_len: 256, kv_cache_memory_bytes: 268435456, hf_token: {SECRETS['engine_token']}}}
          batch_size: 8
          runtime_env:
            env_vars: {{HF_TOKEN: {SECRETS['hf_token']}, OPENAI_API_KEY: {SECRETS['api_key']},
                        AWS_SECRET_ACCESS_KEY: "${{MY_AWS_SECRET}}"}}
        preprocess: hooks:request
        output: {{path: out/answers.parquet, columns: [id, kind, generated_text]}}
    """))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MY_AWS_SECRET": SECRETS["env_ref"]}
    # the job's own process: all it prints reaches the terminal (status: in this process)
    proc = subprocess.run([sys.executable, "-m", "llmbatch", "run", str(tmp / "job.yaml")],
                          capture_output=True, text=True, env=env, timeout=900)
    status = llmbatch("status", str(tmp / "out" / "answers.parquet.job"), env={"MY_AWS_SECRET": SECRETS["env_ref"]})
    return tmp, proc, status, env


def test_no_secret_reaches_the_job_directory_or_the_terminal(secret_job):
    tmp, proc, status, _ = secret_job
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    job_dir = tmp / "out" / "answers.parquet.job"
    files = [p for p in job_dir.rglob("*") if p.is_file()] + [tmp / "out" / "answers.parquet"]
    assert len(files) > 5
    texts = {str(p): p.read_bytes() for p in files}
    texts["stdout+stderr"] = (proc.stdout + proc.stderr + status.stdout + status.stderr).encode()
    for where, data in texts.items():
        for name, secret in SECRETS.items():
            assert secret.encode() not in data, f"{name} leaked into {where}"
    meta = json.loads((job_dir / "job.json").read_text())
    env_vars = meta["spec"]["model"]["runtime_env"]["env_vars"]
    assert env_vars["AWS_SECRET_ACCESS_KEY"] == "${MY_AWS_SECRET}"  # a reference, kept as written
    assert env_vars["HF_TOKEN"] == "<redacted>" and "alice" not in meta["spec"]["input"]["path"]


def test_a_job_with_literal_secrets_resumes_from_its_job_file(secret_job):
    tmp, _, _, env = secret_job
    job_dir = tmp / "out" / "answers.parquet.job"
    secret_env = {"MY_AWS_SECRET": SECRETS["env_ref"]}
    alone = llmbatch("resume", str(job_dir), env=secret_env)
    assert alone.returncode == 2 and "llmbatch run JOB.yaml" in alone.stderr, alone.stderr[-2000:]
    again = llmbatch("run", str(tmp / "job.yaml"), "--quiet", env=secret_env)
    assert again.returncode == 0, again.stderr[-2000:]  # every row done: it only rewrites the output


def test_the_job_directory_holds_no_pickles(secret_job):
    tmp, proc, _, _ = secret_job
    assert proc.returncode == 0
    job_dir = tmp / "out" / "answers.parquet.job"
    parquet = list(job_dir.rglob("*.parquet"))
    assert any("input" in str(p) for p in parquet) and any("parts" in str(p) for p in parquet)
    for path in parquet:
        schema = pq.read_schema(path)
        assert not any(pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) for f in schema), path
    for path in job_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert b"\x80\x04\x95" not in data and b"\x80\x05\x95" not in data, f"pickle stream in {path}"


def test_dedup_copies_only_deterministic_requests_and_tokens_are_counted_apart(secret_job):
    tmp, proc, _, _ = secret_job
    assert proc.returncode == 0
    job_dir = tmp / "out" / "answers.parquet.job"
    rows = pa.concat_tables([pq.read_table(p) for p in sorted((job_dir / "parts").glob("*.parquet"))],
                            promote_options="permissive").to_pylist()
    assert all(not r["__inference_error__"] for r in rows), [r["__inference_error__"] for r in rows]
    copied = {k: sum(1 for r in rows if r["kind"] == k and r["__llmbatch_stats"]["deduped"]) for k in set(KINDS)}
    assert copied == {"greedy": 3, "seeded": 3, "sampled": 0, "two": 0}, copied
    answers = {k: {r["generated_text"] for r in rows if r["kind"] == k} for k in ("greedy", "seeded")}
    assert all(len(v) == 1 for v in answers.values())  # copies carry the one answer
    stats = json.loads((job_dir / "stats.json").read_text())
    tokens = {r["id"]: r["num_generated_tokens"] for r in rows}
    copies = [int(r["id"]) for r in rows if r["__llmbatch_stats"]["deduped"]]
    assert stats["delivered_tokens"] == sum(tokens.values())
    assert stats["generated_tokens"] == sum(t for i, t in tokens.items() if int(i) not in copies)
    assert stats["generated_tokens"] < stats["delivered_tokens"] and stats["deduplicated_rows"] == 6
