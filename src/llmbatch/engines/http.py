"""An OpenAI-compatible HTTP endpoint behind the engine base class.

A row carries its own request (``payload``, Ray's contract: sent as it is, JSON, or multipart
when a value is bytes, as audio transcription endpoints take it) or asks as rows do for the
local engine (``messages``/``prompt`` with ``sampling_params``, turned into a chat/completions
request by :mod:`llmbatch.engines.openai_api`).

Per worker, many requests are in flight at once (:class:`~llmbatch.engines.limits.AdaptiveConcurrency`,
halved on 429/503 and raised back as answers arrive); the rate limits hold for the whole
processor (:class:`~llmbatch.engines.limits.RateLimits`). A request is retried only where a
retry can help: 408, 425, 429, 500, 502, 503, 504, timeouts, dropped connections, truncated or
invalid bodies; after ``Retry-After`` (or ``retry-after-ms``) when the endpoint sends one, else
after an exponential backoff with jitter. Any other status, or the last failure when the
retries run out, is the row's error: the status and an excerpt of the body.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import itertools
import json
import logging
import random
import time
from typing import Any

from llmbatch.engines.base import Engine, Request
from llmbatch.engines.settings import HttpSettings
from llmbatch.engines.limits import (
    AdaptiveConcurrency,
    RateLimits,
    limiter_name,
    shared_limiter,
)
from llmbatch.engines.openai_api import (
    answer_columns,
    endpoint_url,
    estimate_tokens,
    is_deterministic,
    request_body,
    usage_counts,
)
from llmbatch.errors import (
    EndpointConnectionError,
    EndpointError,
    EndpointTimeoutError,
    HttpStatusError,
    InvalidResponseError,
    ResponseTooLargeError,
    RowValidationError,
)
from llmbatch.redact import redact_text, reveal
from llmbatch.rows import Row, to_python

logger = logging.getLogger(__name__)

#: Statuses worth retrying: the endpoint may answer next time.
RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Statuses that say the endpoint is overloaded: fewer requests in flight.
OVERLOAD_STATUSES = frozenset({429, 503})
#: Longest backoff between two attempts, and longest Retry-After honoured.
MAX_BACKOFF_S = 60.0
MAX_RETRY_AFTER_S = 600.0
#: Characters of an error body kept in the row's error.
BODY_EXCERPT = 300


def excerpt(raw: bytes | str, limit: int = BODY_EXCERPT) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    text = " ".join(text.split())
    return redact_text(text if len(text) <= limit else text[:limit] + "...")


def retry_after(headers: Any) -> float | None:
    """Seconds the endpoint asked to wait (``retry-after-ms``, ``Retry-After`` in seconds or as
    an HTTP date), or None."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def is_multipart(payload: Any) -> bool:
    """A payload goes as multipart/form-data when a value is bytes or a file ``{"content": ...}``."""
    return isinstance(payload, dict) and any(
        isinstance(v, (bytes, bytearray)) or (isinstance(v, dict) and "content" in v) for v in payload.values())


def form_data(payload: dict[str, Any]):
    """A fresh multipart body (one is consumed by each attempt)."""
    import aiohttp

    form = aiohttp.FormData()
    for key, value in payload.items():
        if isinstance(value, dict) and "content" in value:
            form.add_field(key, value["content"], filename=value.get("filename", key), content_type=value.get("content_type"))
        elif isinstance(value, (bytes, bytearray)):
            form.add_field(key, bytes(value), filename=key)
        elif isinstance(value, str):
            form.add_field(key, value)
        else:
            form.add_field(key, json.dumps(value))
    return form


class _Retry(Exception):
    """One failed attempt that a retry may fix: the error it will be if none does."""

    def __init__(self, error: EndpointError, wait: float | None = None, overload: bool = False):
        super().__init__(str(error))
        self.error, self.wait, self.overload = error, wait, overload


#: the largest answer read from an endpoint (a reply over it is the row's error, not a
#: replica's memory: a misbehaving or hostile endpoint can send without end)
MAX_RESPONSE_BYTES = 64 << 20


async def read_capped(resp: Any, limit: int) -> bytes:
    """The body of ``resp`` (aiohttp), refused past ``limit`` bytes as it streams in."""
    length = resp.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ResponseTooLargeError(f"the endpoint's answer is {int(length):,} bytes, over the "
                                    f"{limit:,}-byte limit; ask for less (max_tokens) or raise the limit")
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise ResponseTooLargeError(f"the endpoint's answer passed the {limit:,}-byte limit and was cut "
                                        "off there; ask for less (max_tokens) or raise the limit")
        chunks.append(chunk)
    return b"".join(chunks)


class HttpEngine(Engine):
    """Rows to an OpenAI-compatible endpoint (see module docstring)."""

    #: what a row needs: its own request, or messages/prompt
    required_any = (("payload", "messages", "prompt"),)

    def __init__(self, settings: HttpSettings):
        self.settings = settings
        self.url = settings.url  # where payload rows go (a test points it elsewhere)
        self.headers = dict(settings.headers or {})  # values may be Secret: shown redacted, revealed when sent
        self.capacity = settings.max_concurrent_requests
        self.max_response_bytes = MAX_RESPONSE_BYTES
        self.limiter: Any = None  # the shared schedule's actor, set by prepare() in the driver
        self.session = None
        self._ids = itertools.count()
        self._limits: RateLimits | None = None
        self._concurrency: AdaptiveConcurrency | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """In the driver, when the processor runs: the shared rate schedule, so that the limits
        hold for every worker together."""
        if self.settings.qps or self.settings.tokens_per_minute:
            secret = "".join(str(reveal(v)) for k, v in sorted(self.headers.items()) if k.lower() == "authorization")
            name = limiter_name(self.url, secret, self.settings.qps, self.settings.tokens_per_minute)
            self.limiter = shared_limiter(name, self.settings.qps, self.settings.tokens_per_minute)

    async def start(self) -> None:
        import aiohttp

        if self.settings.session_factory is not None:
            self.session = self.settings.session_factory()
        else:
            connector = aiohttp.TCPConnector(limit=self.capacity + 8, limit_per_host=0, enable_cleanup_closed=True)
            self.session = aiohttp.ClientSession(connector=connector)
        self._concurrency = AdaptiveConcurrency(self.capacity)
        if self.settings.qps or self.settings.tokens_per_minute:
            if self.limiter is None:
                logger.warning("no shared rate schedule (the processor was not run by its driver): the limits hold "
                               "per worker")
            self._limits = RateLimits(self.limiter, self.settings.qps, self.settings.tokens_per_minute)

    async def restart(self) -> None:
        await self.close()
        await self.start()

    async def close(self) -> None:
        if self._limits is not None:
            self._limits.close()
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()

    def is_fatal(self, exc: BaseException) -> bool:
        return False  # an endpoint's failure is the row's; nothing here to restart

    # -- requests ----------------------------------------------------------------------------

    def build_request(self, row: Row) -> Request:
        if row.get("payload") is not None:
            payload = to_python(row["payload"])
            if not isinstance(payload, dict):
                raise RowValidationError(f"'payload' must be a dict (the request body), got {type(payload).__name__}")
            extra = {"kind": None, "tokens": estimate_tokens(payload), "structured": None, "prompt": ""}
            if is_multipart(payload):
                return Request(prompt=self.url, params=payload, extra={**extra, "multipart": True})
            try:
                body = json.dumps(payload, ensure_ascii=False).encode()
            except (TypeError, ValueError) as exc:
                raise RowValidationError(f"'payload' cannot be sent as JSON: {exc}") from exc
            key = hashlib.blake2b(body, digest_size=16).digest() if self.settings.dedup_requests and is_deterministic(payload) else None
            return Request(prompt=self.url, params=body, key=key, extra=extra)
        kind, payload, spec = request_body(row, self.settings.model, self.settings.structured_output_fields)
        body = json.dumps(payload, ensure_ascii=False).encode()
        key = hashlib.blake2b(body, digest_size=16).digest() if self.settings.dedup_requests and is_deterministic(payload) else None
        prompt = row["prompt"] if kind == "completions" else ""
        return Request(prompt=endpoint_url(self.url, kind), params=body, key=key,
                       extra={"kind": kind, "tokens": estimate_tokens(payload), "structured": spec, "prompt": prompt})

    async def run(self, request: Request) -> dict[str, Any]:
        request_id = next(self._ids)
        start = time.perf_counter()
        charged = request.extra["tokens"]
        attempt = 0
        while True:
            attempt += 1
            await self._concurrency.acquire()
            try:
                if self._limits is not None:
                    await self._limits.acquire(charged)
                data = await self._attempt(request)
            except _Retry as retry:
                if retry.overload:
                    self._concurrency.overloaded()
                if attempt > self.settings.max_retries:
                    raise type(retry.error)(f"{retry.error} (after {attempt} attempts)") from None
                wait = retry.wait if retry.wait is not None else self._backoff(attempt)
                logger.debug("attempt %d failed (%s); retrying in %.2f s", attempt, retry.error, wait)
            else:
                self._concurrency.succeeded()
                return self._columns(request, data, request_id, time.perf_counter() - start)
            finally:
                await self._concurrency.release()
            await asyncio.sleep(wait)

    def _backoff(self, attempt: int) -> float:
        cap = min(MAX_BACKOFF_S, self.settings.base_retry_wait_time_in_s * 2 ** (attempt - 1))
        return cap * random.uniform(0.5, 1.0)

    def _headers(self, multipart: bool) -> dict[str, str]:
        headers = {k: str(reveal(v)) for k, v in self.headers.items()}
        if multipart:
            return {k: v for k, v in headers.items() if k.lower() != "content-type"}
        return {"Content-Type": "application/json", **headers}

    async def _attempt(self, request: Request) -> Any:
        """One attempt: the parsed JSON answer, or :class:`_Retry`; raises the row's error for
        statuses a retry cannot fix."""
        import aiohttp

        multipart = request.extra.get("multipart", False)
        body = form_data(request.params) if multipart else request.params
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout_s)
        try:
            async with self.session.post(request.prompt, data=body, headers=self._headers(multipart),
                                         timeout=timeout) as resp:
                status, reason, headers = resp.status, resp.reason or "", resp.headers
                raw = await read_capped(resp, self.max_response_bytes)
        except asyncio.TimeoutError:
            raise _Retry(EndpointTimeoutError(f"no complete answer within request_timeout_s={self.settings.request_timeout_s:g} s"))
        except aiohttp.ClientPayloadError as exc:
            raise _Retry(InvalidResponseError(f"the answer was cut off ({type(exc).__name__}: {excerpt(str(exc), 160)})"))
        except aiohttp.ClientConnectionError as exc:
            raise _Retry(EndpointConnectionError(f"{type(exc).__name__}: {excerpt(str(exc), 160) or 'connection failed'}"))
        except aiohttp.ClientError as exc:
            raise EndpointError(f"{type(exc).__name__}: {excerpt(str(exc), 160)}") from None
        if status in RETRY_STATUSES:
            wait = retry_after(headers)
            raise _Retry(HttpStatusError(f"HTTP {status} {reason}: {excerpt(raw)}", status),
                         None if wait is None else min(wait, MAX_RETRY_AFTER_S), overload=status in OVERLOAD_STATUSES)
        if not 200 <= status < 300:
            raise HttpStatusError(f"HTTP {status} {reason}: {excerpt(raw)}", status)
        try:
            return json.loads(raw)
        except ValueError:
            raise _Retry(InvalidResponseError(f"HTTP {status} with a body that is not JSON: {excerpt(raw, 160)!r}"))

    def _columns(self, request: Request, data: Any, request_id: int, elapsed: float) -> dict[str, Any]:
        prompt_tokens, completion_tokens, cached = usage_counts(data)
        if self._limits is not None and isinstance(data, dict):
            total = (data.get("usage") or {}).get("total_tokens") or prompt_tokens + completion_tokens
            self._limits.charge(int(total or 0) - request.extra["tokens"])
        out: dict[str, Any] = {"http_response": data, "num_input_tokens": prompt_tokens,
                               "num_generated_tokens": completion_tokens, "time_taken_llm": elapsed,
                               "request_id": request_id, "num_cached_tokens": cached}
        kind = request.extra["kind"]
        if kind is not None:
            out.update(answer_columns(kind, data, request.extra.get("prompt", "")))
        return out
