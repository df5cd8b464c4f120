"""Secrets never reach a job directory or a client: every header value and every
environment value that is not a ``${VAR}`` reference is redacted whatever its name, secret
names in any spelling (camelCase, vendors' header names) are caught, and token-looking text
in error messages and logs is masked."""

from __future__ import annotations

from llmbatch.redact import REDACTED, is_secret_key, redact, redact_text

SECRET = "s3cr3t-Value-9f8e7d6c5b4a"


def test_every_header_and_env_value_is_redacted_whatever_its_name():
    spec = {"model": {"headers": {"Ocp-Apim-Subscription-Key": SECRET, "x-functions-key": SECRET,
                                  "X-Custom-Thing": SECRET, "Authorization": "Bearer ${OPENAI_API_KEY}",
                                  "Content-Type": "application/json"},
                      "runtime_env": {"env_vars": {"OPENAI_KEY": SECRET, "AZURE_OPENAI_KEY": SECRET, "MY_VAR": SECRET,
                                                   "HF_TOKEN": "${HF_TOKEN}"}}}}
    out = redact(spec)
    assert SECRET not in repr(out)
    headers, env = out["model"]["headers"], out["model"]["runtime_env"]["env_vars"]
    assert headers["X-Custom-Thing"] == REDACTED and headers["Content-Type"] == "application/json"
    assert headers["Authorization"] == "Bearer ${OPENAI_API_KEY}" and env["HF_TOKEN"] == "${HF_TOKEN}"
    assert env["MY_VAR"] == REDACTED


def test_secret_names_in_any_spelling():
    for name in ("Ocp-Apim-Subscription-Key", "x-functions-key", "OPENAI_KEY", "AZURE_OPENAI_KEY", "accessToken",
                 "clientSecret", "api_keys", "storage_key", "refreshToken", "key"):
        assert is_secret_key(name), name
        assert redact({name: SECRET}) == {name: REDACTED}, name
    for name in ("max_tokens", "max_num_batched_tokens", "sort_key", "id_column", "api_key_env", "cache_key",
                 "num_generated_tokens", "monkey"):
        assert not is_secret_key(name), name


def test_token_patterns_are_masked_in_texts():
    texts = [f"401 from endpoint: {{\"error\": \"Incorrect API key provided: sk-proj-{'a' * 40}\"}}",
             f"hf_{'B' * 34} rejected", "AWS said AKIAIOSFODNN7EXAMPLE is unknown", f"Authorization: Bearer {SECRET}",
             f'body {{"clientSecret": "{SECRET}", "accessToken": "{SECRET}"}}', f"retrying with api_key={SECRET}",
             f"token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.{'c' * 20}"]
    for text in texts:
        out = redact_text(text)
        assert REDACTED in out, out
        for leaked in (SECRET, "a" * 40, "B" * 34, "IOSFODNN7EXAMPLE", "eyJzdWIi"):
            assert leaked not in out, out
    plain = "line 3: max_tokens=16 is over the model's limit; KeyError: 'messages'; missing key: 'custom_id'"
    assert redact_text(plain) == plain
