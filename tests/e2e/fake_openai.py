"""A fault-injecting OpenAI-compatible server on loopback (aiohttp), for tests and bench/.

    python tests/e2e/fake_openai.py --port-file PORT [--latency 0.2] [--qps 100] [--tpm 240000]

It answers ``/v1/chat/completions`` and ``/v1/completions`` after ``--latency`` seconds with a
deterministic answer and its ``usage``, enforces the rate limits as a provider does (a request
over them gets 429 and is counted in ``limit_429``), and counts what it saw: ``GET /stats``.

Faults are asked for by the request itself: a message or prompt containing ``fault=<name>``.
``<name>`` on the first attempt only (the retry gets an answer): ``429``, ``429ra`` (with
``Retry-After: 1``), ``500``, ``502``, ``503``, ``slow`` (answers after ``--slow`` seconds),
``drop`` (closes the connection without answering), ``badjson`` (200 with a body that is not
JSON), ``truncated`` (200 whose body stops short of its Content-Length). On every attempt:
``bad400`` (400 with a JSON error body), ``always500``, ``alwaysslow``, ``alwaysdrop``.

``POST /hold`` keeps every request that arrives (counted, not answered) until ``POST /release``
(or ``/reset``): a test then knows which requests are in flight (``in_flight`` in ``/stats``).
A test that runs it asks through :func:`stats` and :func:`post`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import re
import time
import urllib.request

from aiohttp import web

FAULT = re.compile(r"fault=(\w+)")
ONCE = {"429", "429ra", "500", "502", "503", "slow", "drop", "badjson", "truncated"}


def stats(url: str) -> dict:
    """The counts of the server at ``url`` (``GET /stats``)."""
    return json.loads(urllib.request.urlopen(f"{url}/stats", timeout=10).read())


def post(url: str, action: str) -> None:
    """``POST /reset``, ``/hold`` or ``/release`` to the server at ``url``."""
    urllib.request.urlopen(urllib.request.Request(f"{url}/{action}", method="POST"), timeout=10).read()


class Window:
    """Sliding-window counts over arrival times (monotonic seconds)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.items: collections.deque = collections.deque()
        self.total = 0.0
        self.max_total = 0.0

    def add(self, now: float, amount: float) -> float:
        while self.items and self.items[0][0] <= now - self.seconds:
            self.total -= self.items.popleft()[1]
        self.items.append((now, amount))
        self.total += amount
        self.max_total = max(self.max_total, self.total)
        return self.total

    def would_be(self, now: float, amount: float) -> float:
        while self.items and self.items[0][0] <= now - self.seconds:
            self.total -= self.items.popleft()[1]
        return self.total + amount


class Server:
    def __init__(self, args):
        self.args = args
        self.reset()

    def reset(self) -> None:
        self.attempts: collections.Counter = collections.Counter()
        self.statuses: collections.Counter = collections.Counter()
        self.requests = Window(1.0)
        self.tokens = Window(self.args.token_window)
        self.limit_429 = 0
        self.first_at = None
        self.last_at = None
        self.answered = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.auth_failures = 0
        self.released = asyncio.Event()  # cleared by POST /hold
        self.released.set()

    def stats(self) -> dict:
        return {"statuses": dict(self.statuses), "limit_429": self.limit_429, "answered": self.answered,
                "max_requests_per_s": self.requests.max_total, "max_tokens_per_window": self.tokens.max_total,
                "token_window_s": self.args.token_window, "first_at": self.first_at, "last_at": self.last_at,
                "in_flight": self.in_flight, "max_in_flight": self.max_in_flight, "auth_failures": self.auth_failures,
                "attempts": sum(self.attempts.values()), "keys": len(self.attempts)}

    def token_limit(self) -> float | None:
        return self.args.tpm * self.args.token_window / 60 if self.args.tpm else None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        now = time.monotonic()
        self.first_at = self.first_at or time.time()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._handle(request, now)
        finally:
            self.in_flight -= 1
            self.last_at = time.time()

    def _reply(self, status: int, body: dict, headers: dict | None = None) -> web.Response:
        self.statuses[status] += 1
        return web.json_response(body, status=status, headers=headers)

    async def _handle(self, request: web.Request, now: float) -> web.StreamResponse:
        if self.args.api_key and request.headers.get("Authorization") != f"Bearer {self.args.api_key}":
            self.auth_failures += 1
            return self._reply(401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        if chat:
            texts = [m["content"] if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
                     for m in body.get("messages", [])]
        else:
            texts = [body.get("prompt", "")]
        text = "\n".join(texts)
        if self.args.qps and self.requests.add(now, 1) > self.args.qps:
            self.limit_429 += 1
            return self._reply(429, {"error": {"message": "rate limit (requests) exceeded", "type": "requests"}})
        prompt_tokens = sum(math.ceil(len(t.encode()) / 4) + 3 for t in texts)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        words = (f"answer to {text}".split())[:max_tokens]
        answer = " ".join(words)
        choice = (body.get("structured_outputs") or {}).get("choice") or body.get("guided_choice")
        if choice:
            answer = choice[sum(text.encode()) % len(choice)]
            words = answer.split()
        total = prompt_tokens + len(words)
        limit = self.token_limit()
        if limit and self.tokens.would_be(now, total) > limit:
            self.limit_429 += 1
            return self._reply(429, {"error": {"message": "rate limit (tokens) exceeded", "type": "tokens"}})
        match = FAULT.search(text)
        fault = match.group(1) if match else None
        self.attempts[text] += 1
        first = self.attempts[text] == 1
        if fault and (first or fault not in ONCE):
            reply = await self._fault(request, fault)
            if reply is not None:
                return reply
        await self.released.wait()
        if self.args.latency:
            await asyncio.sleep(self.args.latency)
        if limit:
            self.tokens.add(now, total)
        self.answered += 1
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words), "total_tokens": total}
        if chat:
            out = {"id": "chatcmpl-x", "object": "chat.completion", "created": int(time.time()), "model": body.get("model"),
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                "finish_reason": "length" if len(words) == max_tokens else "stop"}], "usage": usage}
        else:
            out = {"id": "cmpl-x", "object": "text_completion", "created": int(time.time()), "model": body.get("model"),
                   "choices": [{"index": 0, "text": answer, "finish_reason": "stop"}], "usage": usage}
        return self._reply(200, out)

    async def _fault(self, request: web.Request, fault: str) -> web.StreamResponse | None:
        name = fault.removeprefix("always")
        if name in ("429", "429ra"):
            headers = {"Retry-After": "1"} if name == "429ra" else None
            return self._reply(429, {"error": {"message": "slow down", "type": "injected"}}, headers)
        if name in ("500", "502", "503"):
            return self._reply(int(name), {"error": {"message": f"injected {name}", "type": "injected"}})
        if name == "bad400":
            return self._reply(400, {"error": {"message": "this payload is not acceptable: fault=bad400",
                                               "type": "invalid_request_error"}})
        if name == "slow":
            await asyncio.sleep(self.args.slow)
            return None
        if name == "drop":
            self.statuses["dropped"] += 1
            request.transport.close()
            raise asyncio.CancelledError
        if name == "badjson":
            self.statuses["badjson"] += 1
            return web.Response(status=200, text="{not json: <html>oops</html>", content_type="application/json")
        if name == "truncated":
            self.statuses["truncated"] += 1
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json", "Content-Length": "500"})
            await resp.prepare(request)
            await resp.write(b'{"id": "chatcmpl-x", "choices": [{"index": 0, "mess')
            request.transport.close()
            return resp
        return None


async def main(args) -> None:
    server = Server(args)
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", server.handle)
    app.router.add_post("/v1/completions", server.handle)

    async def stats(request):
        return web.json_response(server.stats())

    async def reset(request):
        server.released.set()  # requests held by the last test are answered
        server.reset()
        return web.json_response({"ok": True})

    async def hold(request):
        server.released.clear()
        return web.json_response({"ok": True})

    async def release(request):
        server.released.set()
        return web.json_response({"ok": True})

    app.router.add_get("/stats", stats)
    app.router.add_post("/reset", reset)
    app.router.add_post("/hold", hold)
    app.router.add_post("/release", release)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as fh:
            fh.write(str(port))
        import os

        os.replace(args.port_file + ".tmp", args.port_file)
    print(f"listening on {port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument("--slow", type=float, default=3.0, help="seconds a 'slow' fault takes")
    parser.add_argument("--qps", type=float, default=None, help="requests per second allowed (any 1 s window)")
    parser.add_argument("--tpm", type=float, default=None, help="tokens per minute allowed")
    parser.add_argument("--token-window", type=float, default=10.0,
                        help="the window tokens are counted over (the limit scaled to it), as providers quantize")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>'")
    asyncio.run(main(parser.parse_args()))
