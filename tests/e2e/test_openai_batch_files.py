"""OpenAI batch files through `llmbatch run --openai-batch` on the real engine: output and
error lines parse with the openai SDK's types, every custom_id is in exactly one of them."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
from pathlib import Path

import pytest
from inproc import llmbatch

pytestmark = pytest.mark.e2e

QUICK = ["--set", "model.engine_kwargs.max_model_len=512"]  # the suite's usual engine (a warm one)


def run_cli(*args: str, settings: list[str] = QUICK) -> subprocess.CompletedProcess:
    """The CLI in this process (tests/e2e/inproc.py): what these jobs do, not their process."""
    return llmbatch("run", *args, "--quiet", *settings)


def request(custom_id, url, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "smollm2-135m-instruct", **body}})


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_chat_and_completions_file_in_and_out(ray_cluster, smollm2, tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    hi = [{"role": "user", "content": "Say hi"}]
    lines = [
        request("greedy", "/v1/chat/completions", messages=hi, max_tokens=4, temperature=0),
        request("two", "/v1/chat/completions", messages=hi, max_completion_tokens=3, temperature=0.8, seed=1, n=2,
                logprobs=True, top_logprobs=2),
        request("json", "/v1/chat/completions", messages=[{"role": "user", "content": "A JSON object please"}],
                temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}),
        request("text", "/v1/completions", prompt=["Once upon a", "The sky is"], max_tokens=3, temperature=0,
                logprobs=1, stop=["\n"]),
        request("too-long", "/v1/chat/completions", messages=[{"role": "user", "content": "word " * 600}],
                max_tokens=4),
        request("bad", "/v1/chat/completions", messages=hi, tools=[{"type": "function"}]),
    ]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "results.jsonl"

    strict = run_cli("--openai-batch", str(tmp_path / "requests.jsonl"), "--output", str(out))
    assert strict.returncode == 2 and "line 6: unsupported_parameter" in strict.stderr and not out.exists()

    done = run_cli("--openai-batch", str(tmp_path / "requests.jsonl"), "--output", str(out), "--invalid-lines", "error")
    assert done.returncode == 0, done.stderr[-3000:]
    answers, errors = read_lines(out), read_lines(tmp_path / "results.errors.jsonl")
    ids = [a["custom_id"] for a in answers] + [e["custom_id"] for e in errors]
    assert sorted(ids) == sorted(["greedy", "two", "json", "text", "too-long", "bad"])  # each exactly once
    by_id = {a["custom_id"]: a for a in answers}
    for answer in answers:
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        body = answer["response"]["body"]
        (Completion if body["object"] == "text_completion" else ChatCompletion).model_validate(body)
    two = ChatCompletion.model_validate(by_id["two"]["response"]["body"])
    assert len(two.choices) == 2 and all(len(c.logprobs.content) == len(c.logprobs.content) > 0 for c in two.choices)
    assert all(len(t.top_logprobs) == 2 for c in two.choices for t in c.logprobs.content)
    assert json.loads(by_id["json"]["response"]["body"]["choices"][0]["message"]["content"])["a"] is not None
    text = Completion.model_validate(by_id["text"]["response"]["body"])
    assert [c.index for c in text.choices] == [0, 1] and text.usage.completion_tokens <= 6
    assert {e["custom_id"]: e["error"]["code"] for e in errors} == {"too-long": "context_length_exceeded",
                                                                    "bad": "unsupported_parameter"}
    assert all(e["response"] is None and e["id"].startswith("batch_req_") for e in errors)


def test_embeddings_file_in_and_out(ray_cluster, minilm, tmp_path):
    from openai.types import CreateEmbeddingResponse

    lines = [json.dumps({"custom_id": "one", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": "all-minilm-l6-v2", "input": "hello world"}}),
             json.dumps({"custom_id": "two", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": "all-minilm-l6-v2", "input": ["a", "hello world"],
                                  "encoding_format": "base64"}})]
    (tmp_path / "embed.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "vectors.jsonl"
    # no --model: the job runs the model the file names (an embedding model: task_type embed)
    done = run_cli("--openai-batch", str(tmp_path / "embed.jsonl"), "--output", str(out),
                   settings=["--set", "model.engine_kwargs.max_model_len=256"])  # examples/embed.yaml's engine
    assert done.returncode == 0, done.stderr[-3000:]
    by_id = {a["custom_id"]: a["response"]["body"] for a in read_lines(out)}
    one = CreateEmbeddingResponse.model_validate(by_id["one"])
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384 and one.usage.prompt_tokens > 0
    two = by_id["two"]["data"]
    assert [d["index"] for d in two] == [0, 1]
    decoded = struct.unpack("<384f", base64.b64decode(two[1]["embedding"]))
    assert max(abs(a - b) for a, b in zip(decoded, one.data[0].embedding)) < 1e-4  # same input, same vector
    assert not (tmp_path / "vectors.errors.jsonl").read_text()
