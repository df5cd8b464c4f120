"""The HTTP engine against a small aiohttp server in the test's own loop: what is retried and
how, what becomes a row's error, multipart bodies, secrets, rate limits."""

from __future__ import annotations

import asyncio
import collections
import json
import time

import pytest
from aiohttp import web

from llmbatch.engines.http import HttpEngine, retry_after
from llmbatch.engines.settings import HttpSettings
from llmbatch.errors import (
    EndpointConnectionError,
    EndpointTimeoutError,
    HttpStatusError,
    InvalidResponseError,
)
from llmbatch.redact import REDACTED, Secret
from llmbatch.rows import ERROR_COLUMN
from llmbatch.stages.engine import EngineStage

ANSWER = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


class Endpoint:
    """Answers by a script per request text: a list of actions, one per attempt."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = script
        self.attempts: collections.Counter = collections.Counter()
        self.seen_headers: list[dict] = []
        self.forms: list[dict] = []
        self.times: list[float] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.times.append(time.monotonic())
        self.seen_headers.append(dict(request.headers))
        if request.content_type.startswith("multipart/"):
            form = await request.post()
            self.forms.append({k: (v.filename, v.file.read()) if hasattr(v, "file") else v for k, v in form.items()})
            return web.json_response({"text": "transcribed"})
        body = await request.json()
        key = body["messages"][0]["content"] if "messages" in body else body.get("prompt", "")
        n = self.attempts[key]
        self.attempts[key] += 1
        actions = self.script.get(key, ["ok"])
        action = actions[min(n, len(actions) - 1)]
        if action == "ok":
            return web.json_response(ANSWER)
        if action.startswith("status:"):
            status = int(action.split(":")[1])
            return web.json_response({"error": {"message": f"nope {status}"}}, status=status)
        if action == "429ms":
            return web.json_response({"error": "slow down"}, status=429, headers={"retry-after-ms": "300"})
        if action == "slow":
            await asyncio.sleep(2)
            return web.json_response(ANSWER)
        if action == "drop":
            request.transport.close()
            raise asyncio.CancelledError
        if action == "huge":  # streamed without a length, past the engine's limit
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            for _ in range(64):
                await resp.write(b" " * 65536)
            await resp.write_eof()
            return resp
        if action == "badjson":
            return web.Response(text="<html>", content_type="application/json")
        raise AssertionError(action)


def run(endpoint: Endpoint, coro_fn, **engine_kwargs):
    async def go():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", endpoint.handle)
        app.router.add_post("/v1/audio/transcriptions", endpoint.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        engine = HttpEngine(HttpSettings(f"http://127.0.0.1:{port}/v1/chat/completions", **{
            "model": "m", "max_retries": 2, "base_retry_wait_time_in_s": 0.01, "request_timeout_s": 0.5, **engine_kwargs}))
        await engine.start()
        try:
            return await coro_fn(engine, port)
        finally:
            await engine.close()
            await runner.cleanup()

    return asyncio.run(go())


def chat_row(text: str, **params) -> dict:
    return {"messages": [{"role": "user", "content": text}], "sampling_params": {"temperature": 0, **params}}


async def _one(engine, text):
    return await engine.run(engine.build_request(chat_row(text)))


@pytest.mark.parametrize("actions,error,message,attempts", [
    (["status:400"], HttpStatusError, "HTTP 400 Bad Request: {\"error\": {\"message\": \"nope 400\"}}", 1),
    (["status:404"], HttpStatusError, "HTTP 404", 1),
    (["status:500"], HttpStatusError, "HTTP 500 Internal Server Error: .* \\(after 3 attempts\\)", 3),
    (["status:503"], HttpStatusError, "HTTP 503", 3),
    (["slow"], EndpointTimeoutError, "request_timeout_s=0.5 s \\(after 3 attempts\\)", 3),
    (["drop"], EndpointConnectionError, "after 3 attempts", 3),
    (["badjson"], InvalidResponseError, "not JSON: '<html>'", 3),
])
def test_failures_become_the_rows_error_retried_only_where_it_can_help(actions, error, message, attempts):
    endpoint = Endpoint({"q": actions})
    with pytest.raises(error, match=message):
        run(endpoint, lambda e, _: _one(e, "q"))
    assert endpoint.attempts["q"] == attempts


@pytest.mark.parametrize("first", ["status:429", "status:408", "status:502", "status:504", "slow", "drop", "badjson"])
def test_a_transient_failure_is_retried_and_answered(first):
    endpoint = Endpoint({"q": [first, "ok"]})
    out = run(endpoint, lambda e, _: _one(e, "q"))
    assert out["generated_text"] == "ok" and out["num_input_tokens"] == 3 and out["http_response"] == ANSWER
    assert endpoint.attempts["q"] == 2


def test_retry_after_is_honoured():
    endpoint = Endpoint({"q": ["429ms", "ok"]})
    run(endpoint, lambda e, _: _one(e, "q"))
    assert endpoint.times[1] - endpoint.times[0] >= 0.29


def test_retry_after_forms():
    assert retry_after({"retry-after": "2"}) == 2.0
    assert retry_after({"retry-after-ms": "150", "retry-after": "9"}) == 0.15
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0
    assert retry_after({"retry-after": "soon"}) is None and retry_after({}) is None


def test_overload_halves_the_requests_in_flight():
    endpoint = Endpoint({"q": ["status:429", "ok"]})

    async def go(engine, _):
        await _one(engine, "q")
        return engine._concurrency

    concurrency = run(endpoint, go, max_concurrent_requests=8)
    assert concurrency.cuts == 1 and concurrency.limit < 8


def test_bytes_go_as_multipart_and_secrets_only_on_the_wire():
    endpoint = Endpoint({})

    async def go(engine, port):
        engine.url = f"http://127.0.0.1:{port}/v1/audio/transcriptions"
        row = {"payload": {"model": "whisper", "file": {"content": b"RIFF..", "filename": "a.wav",
                                                         "content_type": "audio/wav"}, "language": "en"}}
        return await engine.run(engine.build_request(row))

    secret = Secret("Bearer sk-very-secret-123")
    out = run(endpoint, go, headers={"Authorization": secret, "X-Team": "a"})
    assert out["http_response"] == {"text": "transcribed"}
    assert endpoint.forms == [{"model": "whisper", "file": ("a.wav", b"RIFF.."), "language": "en"}]
    assert endpoint.seen_headers[0]["Authorization"] == "Bearer sk-very-secret-123"
    assert "multipart/form-data" in endpoint.seen_headers[0]["Content-Type"]
    assert REDACTED in repr({"Authorization": secret}) and "sk-very" not in repr(secret)


def test_payload_rows_go_as_they_are():
    endpoint = Endpoint({})

    async def go(engine, _):
        request = engine.build_request({"payload": {"model": "x", "messages": [{"role": "user", "content": "q"}],
                                                    "temperature": 0.0}})
        assert request.key is not None  # greedy: identical payloads are sent once
        return await engine.run(request)

    out = run(endpoint, go)
    assert out["http_response"] == ANSWER and "generated_text" not in out


def test_rate_limit_spaces_requests_in_one_worker():
    endpoint = Endpoint({})

    async def go(engine, _):
        await asyncio.gather(*(_one(engine, f"q{i}") for i in range(9)))

    run(endpoint, go, qps=20)
    assert endpoint.times[-1] - endpoint.times[0] >= 8 * 1.05 / 20 - 0.01


def test_the_engine_stage_turns_a_400_into_an_error_row_and_answers_the_rest():
    endpoint = Endpoint({"bad": ["status:400"]})

    async def go(engine, _):
        stage = EngineStage(engine, max_pending_requests=8, sort_by_prefix=False)
        await stage.start()
        rows = [chat_row("good"), chat_row("bad"), chat_row("other")]
        out = []
        async for chunk in stage(rows):
            out.extend(chunk)
        return out

    out = run(endpoint, go)
    errors = {r["messages"][0]["content"]: r[ERROR_COLUMN] for r in out}
    assert errors["good"] == "" and errors["other"] == ""
    assert errors["bad"].startswith('engine: HttpStatusError: HTTP 400 Bad Request: {"error"')
    assert json.dumps(errors)  # plain text


def test_an_answer_over_the_size_limit_is_the_rows_error_and_not_retried():
    from llmbatch.errors import ResponseTooLargeError

    endpoint = Endpoint({"q": ["huge"]})

    async def one(engine, _):
        engine.max_response_bytes = 1 << 20  # the reply streams 4 MiB
        return await _one(engine, "q")

    with pytest.raises(ResponseTooLargeError, match="passed the 1,048,576-byte limit"):
        run(endpoint, one)
    assert endpoint.attempts["q"] == 1
