"""Rows to OpenAI requests and answers back: one job file, any model stage."""

from __future__ import annotations

import pytest

from llmbatch.errors import InvalidResponseError, RowValidationError
from llmbatch.openai.client import (
    answer_columns,
    endpoint_url,
    estimate_tokens,
    is_deterministic,
    request_body,
)
from llmbatch.openai.requests import row_from_request
from llmbatch.openai.responses import response_object
from llmbatch.openai.vocab import CHAT, COMPLETIONS


def test_endpoint_url_from_the_endpoint_or_its_base():
    assert endpoint_url("http://h:8000/v1/chat/completions", CHAT) == "http://h:8000/v1/chat/completions"
    assert endpoint_url("http://h:8000/v1/chat/completions", COMPLETIONS) == "http://h:8000/v1/completions"
    assert endpoint_url("http://h:8000/v1/completions", CHAT) == "http://h:8000/v1/chat/completions"
    assert endpoint_url("http://h:8000/v1/", COMPLETIONS) == "http://h:8000/v1/completions"


def test_messages_and_sampling_params_become_a_chat_request():
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
           "sampling_params": {"temperature": 0, "max_tokens": 8, "top_k": 5, "logprobs": 2, "detokenize": True,
                               "structured_outputs": {"choice": ["a", "b"]}}}
    kind, body, spec = request_body(row, "smol")
    assert kind == CHAT and spec == {"choice": ["a", "b"]}
    assert body == {"messages": [{"role": "user", "content": "hi"}], "model": "smol", "max_tokens": 8, "temperature": 0,
                    "top_k": 5, "logprobs": True, "top_logprobs": 2, "structured_outputs": {"choice": ["a", "b"]}}
    assert is_deterministic(body)


def test_a_prompt_becomes_a_completions_request_with_vllms_default_max_tokens():
    kind, body, _ = request_body({"prompt": "Once", "sampling_params": {"logprobs": 1}, "model": "row-model"}, "smol")
    assert kind == COMPLETIONS and body == {"prompt": "Once", "model": "row-model", "max_tokens": 16, "logprobs": 1}
    assert not is_deterministic(body)  # the endpoint's default temperature


def test_json_schemas_go_as_response_format_and_guided_fields_on_request():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    row = {"prompt": "x", "sampling_params": {"structured_outputs": {"json": schema}}}
    _, body, _ = request_body(row, None)
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    assert "model" not in body
    _, body, _ = request_body({"prompt": "x", "sampling_params": {"guided_decoding": {"regex": "[ab]"}}}, None, "guided")
    assert body["guided_regex"] == "[ab]"


@pytest.mark.parametrize("params,message", [
    ({"max_token": 3}, "did you mean 'max_tokens'"),
    ({"temperature": "hot"}, "must be a number"),
    ({"structured_outputs": {"choices": ["a"]}}, "did you mean 'choice'"),
    ({"structured_outputs": {"regex": "("}}, "not a valid regular expression"),
])
def test_bad_rows_fail_alone_naming_the_field(params, message):
    with pytest.raises(RowValidationError, match=message):
        request_body({"prompt": "x", "sampling_params": params}, "m")


def test_a_row_without_a_request_is_refused():
    with pytest.raises(RowValidationError, match="neither"):
        request_body({"prompt": "  "}, "m")


def test_answers_become_llmbatch_columns():
    data = {"choices": [{"message": {"content": "Retail"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}}
    out = answer_columns(CHAT, data)
    assert out["generated_text"] == "Retail" and out["finish_reason"] == "stop"
    assert (out["num_input_tokens"], out["num_generated_tokens"]) == (12, 2)
    assert answer_columns(COMPLETIONS, {"choices": [{"text": "x"}]}, "p")["prompt"] == "p"
    with pytest.raises(InvalidResponseError):
        answer_columns(CHAT, {"error": "x"})


def test_token_estimate_counts_the_prompt_and_max_tokens():
    body = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 10}
    assert estimate_tokens(body) == 10 + 4 + 3 + 10
    assert estimate_tokens({"prompt": "abcd", "max_tokens": 5, "n": 2}) == 1 + 3 + 10


def test_serving_side_round_trip():
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
               "temperature": 0, "response_format": {"type": "json_object"}, "guided_choice": ["a"]}
    row = row_from_request(CHAT, request)
    assert row["messages"] == request["messages"]
    assert row["sampling_params"] == {"temperature": 0, "max_tokens": 4,
                                      "structured_outputs": {"choice": ["a"], "json_object": True}}
    answer = response_object(CHAT, "m", {"generated_text": "a", "finish_reason": "stop", "num_input_tokens": 3,
                                       "num_generated_tokens": 1})
    assert answer_columns(CHAT, answer)["generated_text"] == "a"
    assert answer["usage"]["total_tokens"] == 4
    assert row_from_request(COMPLETIONS, {"prompt": ["p"]})["prompt"] == "p"


@pytest.mark.parametrize("spec", [{"json": "[1, 2]"}, {"json": "{not json"}, {"json": {"type": "nope"}},
                                  {"regex": "("}, {"choice": []}, {"choice": ["a", 1]}])
def test_an_endpoint_checks_structured_outputs_as_the_engines_do(spec):
    """One check of a structured-output spec for every engine (it had drifted: a JSON schema
    that is not an object got a different message on the HTTP path)."""
    from llmbatch.params import structured_spec
    from llmbatch.params import validate_structured

    with pytest.raises(RowValidationError) as engine:
        validate_structured(spec)
    with pytest.raises(RowValidationError) as endpoint:
        structured_spec(spec)
    assert str(endpoint.value) == str(engine.value)
