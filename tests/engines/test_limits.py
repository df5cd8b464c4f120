"""Rate limits that hold over any window, and concurrency that backs off and recovers."""

from __future__ import annotations

import asyncio
import random
import time

from llmbatch.engines.limits import (
    MARGIN,
    AdaptiveConcurrency,
    RateLimits,
    RateSchedule,
)


def _max_in_window(times: list[float], weights: list[float], window: float) -> float:
    best, total, j = 0.0, 0.0, 0
    for i, t in enumerate(times):
        total += weights[i]
        while times[j] <= t - window:
            total -= weights[j]
            j += 1
        best = max(best, total)
    return best


def test_requests_per_second_hold_over_any_one_second_window():
    for qps in (1, 7, 21, 100, 1000):
        schedule = RateSchedule(qps=qps)
        arrivals = sorted(random.uniform(0, 0.5) for _ in range(qps * 5))
        slots = [schedule.reserve(now=t) for t in arrivals]
        assert _max_in_window(slots, [1] * len(slots), 1.0) <= qps
        # and it runs near the limit, not far under it
        assert (len(slots) - 1) / (slots[-1] - slots[0]) >= qps / (1 + MARGIN) * 0.99


def test_a_late_send_within_the_margin_stays_under_the_limit():
    schedule = RateSchedule(qps=50)
    slots = [schedule.reserve(now=0.0) for _ in range(500)]
    late = sorted(s + random.uniform(0, 0.9 * MARGIN) for s in slots)
    assert _max_in_window(late, [1] * len(late), 1.0) <= 50


def test_tokens_per_minute_hold_over_a_minute_and_over_shorter_windows():
    rng = random.Random(3)
    schedule = RateSchedule(tokens_per_minute=60_000)
    weights = [rng.randint(5, 200) for _ in range(3000)]
    slots = [schedule.reserve(now=0.0, tokens=w) for w in weights]
    assert _max_in_window(slots, weights, 60.0) <= 60_000
    # smooth: a 10 s window holds its share (plus at most one request)
    assert _max_in_window(slots, weights, 10.0) <= 10_000 + max(weights)


def test_both_limits_apply_and_extra_tokens_push_later_sends_back():
    schedule = RateSchedule(qps=10, tokens_per_minute=600)  # 10 tokens/s
    first = schedule.reserve(0.0, tokens=5)
    second = schedule.reserve(0.0, tokens=5)
    assert abs((second - first) - 0.5 * (1 + MARGIN)) < 1e-9  # the tokens bind, not the 0.1 s spacing
    schedule.charge(second, 20)  # the answer used 20 more than charged
    third = schedule.reserve(0.0, tokens=1)
    assert third - second >= (5 + 20) / 10 * (1 + MARGIN) - 1e-9


def test_local_limits_space_requests():
    async def go():
        limits = RateLimits(None, qps=20)
        start = time.monotonic()
        for _ in range(11):
            await limits.acquire(0)
        return time.monotonic() - start

    assert asyncio.run(go()) >= 10 * (1 + MARGIN) / 20 - 0.01


def test_concurrency_halves_on_overload_and_recovers():
    limit = AdaptiveConcurrency(16, cooldown_s=0.0)
    limit.overloaded()
    assert int(limit.limit) == 8
    limit.overloaded()
    limit.overloaded()
    limit.overloaded()
    limit.overloaded()
    assert int(limit.limit) == 1  # never below one
    for _ in range(400):
        limit.succeeded()
    assert int(limit.limit) == 16  # back, and never above the maximum


def test_concurrency_cuts_once_per_cooldown():
    limit = AdaptiveConcurrency(16, cooldown_s=10.0)
    limit.overloaded()
    limit.overloaded()
    assert int(limit.limit) == 8 and limit.cuts == 1


def test_concurrency_bounds_requests_in_flight():
    limit = AdaptiveConcurrency(3)
    seen = []

    async def one():
        await limit.acquire()
        seen.append(limit.active)
        await asyncio.sleep(0.01)
        await limit.release()

    async def go():
        await asyncio.gather(*(one() for _ in range(12)))

    asyncio.run(go())
    assert max(seen) == 3
