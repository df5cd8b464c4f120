"""One request body, one verdict: a batch file's line and a request to the Ray Serve deployment
are accepted or refused alike, with the same row or the same error text (they had two rule
sets: the Serve path dropped unknown fields and took ``guided_*``, the batch path refused both)."""

from __future__ import annotations

import json

import pytest

from llmbatch.jobs.openai_batch import OpenAIBatchPreprocess
from llmbatch.openai.requests import rows_from_request
from llmbatch.openai.vocab import CHAT, COMPLETIONS
from llmbatch.rows import OPENAI

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}

#: (endpoint, body fields beside model and messages/prompt, the error text or None: accepted)
CASES = {
    "plain": (CHAT, {}, None),
    "unknown field": (CHAT, {"foo": 1}, "unsupported parameter 'foo' for /v1/chat/completions"),
    "a typo": (CHAT, {"temperatur": 0}, "did you mean 'temperature'"),
    "guided_choice": (CHAT, {"guided_choice": ["a", "b"]}, None),
    "guided_json": (CHAT, {"guided_json": SCHEMA}, None),
    "guided_regex on completions": (COMPLETIONS, {"guided_regex": "[ab]"}, None),
    "guided_choice with json_object": (CHAT, {"guided_choice": ["a"], "response_format": {"type": "json_object"}}, None),
    "response_format json_schema": (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA}}}, None),
    "response_format of an unknown type": (CHAT, {"response_format": {"type": "yaml"}},
                                           "response_format type 'yaml' is not supported"),
    "structured_outputs not an object": (CHAT, {"structured_outputs": ["a"]}, "'structured_outputs' must be an object"),
    "temperature a string": (CHAT, {"temperature": "hot"}, "'temperature' must be a number, got 'hot'"),
    "n a float": (CHAT, {"n": 1.5}, "'n' must be an integer"),
    "n two": (CHAT, {"n": 2, "temperature": 1}, None),
    "n zero": (CHAT, {"n": 0}, "'n' must be between 1 and 128"),
    "logprobs": (CHAT, {"logprobs": True, "top_logprobs": 2}, None),
    "top_logprobs alone": (CHAT, {"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
    "completions logprobs": (COMPLETIONS, {"logprobs": 3}, None),
    "completions logprobs out of range": (COMPLETIONS, {"logprobs": 9}, "'logprobs' must be an integer from 0 to 5"),
    "two max tokens": (CHAT, {"max_tokens": 3, "max_completion_tokens": 4}, "give one of max_completion_tokens"),
    "stream": (CHAT, {"stream": True}, "'stream' must be false"),
    "tools": (CHAT, {"tools": [{"type": "function"}]}, "tool calling is not supported"),
    "vLLM's top_k": (CHAT, {"top_k": 5}, None),
    "vLLM's top_k a string": (CHAT, {"top_k": "5"}, "sampling param 'top_k' must be an integer, got '5'"),
    "vLLM's ignore_eos a string": (COMPLETIONS, {"ignore_eos": "yes"}, "'ignore_eos' must be true or false"),
    "vLLM's request_id": (CHAT, {"request_id": "r1"}, None),
    "bookkeeping": (CHAT, {"user": "u", "metadata": {"a": "b"}}, None),
    "echo": (COMPLETIONS, {"echo": True}, "echo is not supported"),
}


def _body(endpoint: str, extra: dict) -> dict:
    return {"model": "m", **({"messages": MESSAGES} if endpoint == CHAT else {"prompt": "Once"}), **extra}


def batch_path(endpoint: str, body: dict) -> dict:
    """A batch file's line as the job's built-in preprocess turns it into a row."""
    row = OpenAIBatchPreprocess()({"url": endpoint, "body": json.dumps(body), "model": body.get("model")})
    return {k: row[k] for k in ("messages", "prompt", "sampling_params", OPENAI) if k in row}


def serve_path(endpoint: str, body: dict) -> dict:
    """A request to the Serve deployment, as its ``chat``/``completions`` turn it into a row."""
    (row,) = rows_from_request(endpoint, body)
    return {k: row[k] for k in ("messages", "prompt", "sampling_params", OPENAI) if k in row}


def _verdict(path, endpoint: str, body: dict):
    try:
        return "accepted", path(endpoint, body)
    except Exception as exc:  # noqa: BLE001 - the verdict compared is the exception itself
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("case", list(CASES))
def test_the_batch_path_and_the_serve_path_give_one_verdict(case):
    endpoint, extra, refused = CASES[case]
    body = _body(endpoint, extra)
    batch, serve = _verdict(batch_path, endpoint, body), _verdict(serve_path, endpoint, body)
    assert batch == serve
    if refused is None:
        assert batch[0] == "accepted", batch
    else:
        assert batch[0] == "RequestError" and refused in batch[1], batch


def test_guided_fields_and_response_format_make_one_structured_spec():
    row = serve_path(CHAT, _body(CHAT, {"guided_choice": ["a"], "response_format": {"type": "json_object"}}))
    assert row["sampling_params"]["structured_outputs"] == {"choice": ["a"], "json_object": True}
    row = serve_path(CHAT, _body(CHAT, {"n": 2, "temperature": 1}))
    assert row["sampling_params"]["n"] == 2 and row[OPENAI]["max_tokens_auto"] is True  # all n answers, as OpenAI
