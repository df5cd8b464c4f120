"""Rate limits and adaptive concurrency for endpoint engines.

A provider's limits (requests per second, tokens per minute) hold for everything sent with one
key, so llmbatch holds them for the whole processor: every worker takes a send time from one
:class:`RateSchedule` that lives in a Ray actor (:func:`shared_limiter`), created by the driver
when the processor runs and shared by every processor of that driver that sends to the same
endpoint with the same key and limits.

The schedule is smooth (GCRA, no burst): consecutive requests are at least one emission
interval apart, and a request's tokens push the next send time back by their share of the
minute. So the limits hold over any window (a second, ten seconds, a minute), the way
providers enforce them when they quantize a per-minute limit into shorter periods. It runs
:data:`MARGIN` under each limit so that a late send (a busy event loop, the network) never
takes the endpoint over it.

Tokens are charged before a request is sent, as OpenAI counts them: the prompt estimate plus
``max_tokens``. When the answer reports more (``usage``), the difference is charged after;
nothing is refunded, so a schedule never runs ahead of the provider's own count.

:class:`AdaptiveConcurrency` is per worker: it halves the requests a worker keeps in flight
when the endpoint says it is overloaded (429, 503) and adds them back one by one as answers
arrive (additive increase, multiplicative decrease).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

#: Share below each limit the schedule runs at.
MARGIN = 0.05
#: A send later than this after its slot takes a new slot (never crowding the next window).
LATE_S = 0.02
#: Slots taken in one call to the shared schedule.
RESERVE_BATCH = 256


class RateSchedule:
    """Send times under ``qps`` requests/s and ``tokens_per_minute`` (either may be None)."""

    def __init__(self, qps: float | None = None, tokens_per_minute: float | None = None, margin: float = MARGIN):
        self.request_interval = (1 + margin) / qps if qps else 0.0
        self.token_interval = (1 + margin) * 60.0 / tokens_per_minute if tokens_per_minute else 0.0
        self._next_request = 0.0
        self._next_token = 0.0

    def reserve(self, now: float, tokens: int = 0) -> float:
        """The time at which a request of ``tokens`` tokens may be sent (>= ``now``)."""
        at = max(now, self._next_request, self._next_token)
        self._next_request = at + self.request_interval
        self._next_token = at + max(0, tokens) * self.token_interval
        return at

    def charge(self, now: float, tokens: int) -> None:
        """Charge tokens an answer used beyond what its request was charged."""
        if tokens > 0 and self.token_interval:
            self._next_token = max(self._next_token, now) + tokens * self.token_interval


class _ScheduleActor:
    """The shared :class:`RateSchedule` (a Ray actor: one per endpoint, key and limits)."""

    def __init__(self, qps: float | None, tokens_per_minute: float | None):
        self.schedule = RateSchedule(qps, tokens_per_minute)

    def reserve(self, tokens: list[int], lead_s: float = 0.0, extra_tokens: int = 0) -> list[float]:
        now = time.time()
        self.schedule.charge(now, extra_tokens)
        return [self.schedule.reserve(now + lead_s, t) for t in tokens]


def limiter_name(url: str, secret: str, qps: float | None, tokens_per_minute: float | None) -> str:
    """The shared schedule's actor name: the endpoint, a digest of its key, the limits."""
    digest = hashlib.sha256(f"{url}\0{secret}\0{qps}\0{tokens_per_minute}".encode()).hexdigest()[:20]
    return f"llmbatch-rate-{digest}"


def shared_limiter(name: str, qps: float | None, tokens_per_minute: float | None):
    """The driver's shared schedule named ``name`` (created at the first call; it lives as long
    as the driver)."""
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=-1)(_ScheduleActor)
    return actor.options(name=name, get_if_exists=True).remote(qps, tokens_per_minute)


class RateLimits:
    """A worker's side of the limits: waits until each request may be sent.

    Requests waiting at the same moment take their slots from the shared schedule in one call;
    without a shared schedule (``handle`` None) the limits hold per worker.
    """

    def __init__(self, handle: Any = None, qps: float | None = None, tokens_per_minute: float | None = None):
        self.handle = handle
        self._local = RateSchedule(qps, tokens_per_minute) if handle is None else None
        self._queue: asyncio.Queue | None = None
        self._pump: asyncio.Task | None = None
        self._extra_tokens = 0
        self._rtt = 0.0
        self.retaken = 0  # slots missed (sent too late) and taken again

    async def acquire(self, tokens: int) -> None:
        """Return when a request of ``tokens`` tokens may be sent now."""
        while True:
            slot = await self._reserve(tokens)
            delay = slot - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.time() - slot <= LATE_S:
                return
            self.retaken += 1

    def charge(self, tokens: int) -> None:
        """Tokens an answer used beyond its charge (sent with the next reservation)."""
        if tokens <= 0:
            return
        if self._local is not None:
            self._local.charge(time.time(), tokens)
        else:
            self._extra_tokens += tokens

    async def _reserve(self, tokens: int) -> float:
        if self._local is not None:
            return self._local.reserve(time.time(), tokens)
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        future = asyncio.get_running_loop().create_future()
        await self._queue.put((tokens, future))
        return await future

    async def _run_pump(self) -> None:
        while True:
            items = [await self._queue.get()]
            while not self._queue.empty() and len(items) < RESERVE_BATCH:
                items.append(self._queue.get_nowait())
            extra, self._extra_tokens = self._extra_tokens, 0
            lead = min(0.25, 2 * self._rtt)  # slots a little ahead, so the answer is not late
            started = time.monotonic()
            try:
                slots = await self.handle.reserve.remote([t for t, _ in items], lead, extra)
            except Exception as exc:  # noqa: BLE001 - every waiting request fails with the reason
                for _, future in items:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self._rtt = 0.8 * self._rtt + 0.2 * (time.monotonic() - started)
            for (_, future), slot in zip(items, slots):
                if not future.done():
                    future.set_result(slot)

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()


class AdaptiveConcurrency:
    """Requests one worker keeps in flight: at most ``maximum``, halved when the endpoint says it
    is overloaded (at most once per ``cooldown_s``), then raised by one per ``limit / 2`` answers."""

    def __init__(self, maximum: int, cooldown_s: float = 1.0):
        self.maximum = max(1, int(maximum))
        self.limit = float(self.maximum)
        self.cooldown_s = cooldown_s
        self.active = 0
        self.cuts = 0
        self._last_cut = float("-inf")
        self._changed: asyncio.Condition | None = None

    async def acquire(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            await self._changed.wait_for(lambda: self.active < int(self.limit))
            self.active += 1

    async def release(self) -> None:
        async with self._changed:
            self.active -= 1
            self._changed.notify_all()

    def overloaded(self) -> None:
        now = time.monotonic()
        if now - self._last_cut < self.cooldown_s:
            return
        self._last_cut = now
        before = int(self.limit)
        self.limit = max(1.0, self.limit / 2)
        self.cuts += 1
        logger.info("endpoint overloaded: requests in flight per worker %d -> %d", before, int(self.limit))

    def succeeded(self) -> None:
        if self.limit < self.maximum:
            self.limit = min(float(self.maximum), self.limit + 2.0 / self.limit)
