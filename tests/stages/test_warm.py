"""Warm engine hosts (llmbatch.stages.warm) on a real Ray cluster, with a fake engine: leases,
the hand-over from a dead lessee, the idle stop, making room, a start that fails, a host that
dies mid-run. The real engine runs warm in every e2e test of the suite (tests/conftest.py),
and tests/e2e/test_warm.py checks that a second run adopts the first run's engine."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from llmbatch.engines.base import Engine, Request
from llmbatch.errors import ConfigError, EngineStartError
from llmbatch.rows import STATS
from llmbatch.stages.engine import EngineStage
from llmbatch.stages import engine_host, warm


class FakeEngine(Engine):
    """Answers each row with the process and the number of starts it has seen."""

    def __init__(self, name: str = "a", fail_start: bool = False, delay_s: float = 0.0):
        self.name = name
        self.fail_start = fail_start
        self.delay_s = delay_s
        self.capacity = 4
        self.starts = 0

    def warm_key(self, gpu: bool = False) -> str:
        return f"fake:{self.name}:{self.fail_start}"

    async def start(self):
        await asyncio.sleep(0.05)
        if self.fail_start:
            raise EngineStartError("the fake engine cannot start: it was told to fail")
        self.starts += 1

    async def restart(self):
        await self.start()

    async def close(self):
        pass

    def is_fatal(self, exc):
        return False

    def build_request(self, row):
        return Request(prompt=row["prompt"], params=None, key=None, sort_key=row["prompt"])

    async def run(self, request):
        await asyncio.sleep(self.delay_s)
        return {"generated_text": f"{os.getpid()}:{self.starts}:{request.prompt}"}


@pytest.fixture(autouse=True)
def by_value(ray_cluster, monkeypatch):
    """Ray pickles this module's classes by reference; its workers cannot import it. The fake
    hosts live in a Ray namespace of their own (the leases run in this process, which reads
    ``warm.NAMESPACE`` at each call), so each test starts and ends with none of them, and the
    real warm engines that other test files left on the worker's cluster stay loaded."""
    from ray import cloudpickle

    monkeypatch.setattr(warm, "NAMESPACE", "llmbatch-warm-tests")
    _stop_all_hosts()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    _stop_all_hosts()


def _stop_all_hosts():
    import ray

    for name in warm._hosts():
        try:
            ray.kill(ray.get_actor(name, namespace=warm.NAMESPACE))
        except ValueError:
            pass
    deadline = time.monotonic() + 30
    while warm._hosts() and time.monotonic() < deadline:
        time.sleep(0.2)


def _stage(name="a", **kw) -> EngineStage:
    return EngineStage(FakeEngine(name, **kw), max_pending_requests=8)


def _key(stage) -> str:
    return warm.warm_key(stage, {})


def _run(coro):
    return asyncio.run(coro)


async def _answer(stage_name="a", rows=3, keep_warm_s=60.0, **kw):
    """A replica's engine stage end to end: lease, rows, release; returns the answers."""
    proxy = warm.WarmEngineStage(_stage(stage_name, **kw), keep_warm_s)
    proxy.prepare()
    proxy.begin()
    await proxy.start()
    out = []
    async for chunk in proxy([{"prompt": f"p{i}"} for i in range(rows)]):
        out.extend(chunk)
    await proxy.close()
    return out


def test_a_second_run_leases_the_warm_engine_of_the_first():
    first = _run(_answer())
    second = _run(_answer())
    assert sorted(r["generated_text"].split(":")[2] for r in first) == ["p0", "p1", "p2"]
    pid1, starts1 = first[0]["generated_text"].split(":")[:2]
    pid2, starts2 = second[0]["generated_text"].split(":")[:2]
    assert (pid1, starts1) == (pid2, starts2) == (pid1, "1"), "the same host's engine, started once"
    assert all(r[STATS]["replica"].endswith(f":{pid1}") for r in first + second)
    assert len(warm._hosts()) == 1


@pytest.mark.parametrize("env", [None, "2"])
def test_other_settings_get_their_own_host_and_the_least_used_makes_room(env, monkeypatch):
    """Up to IDLE_OTHERS_CPU (or LLMBATCH_WARM_IDLE_OTHERS) idle hosts of other settings stay."""
    # where the machine has less than ROOM_FRACTION of its memory available, fewer stay (the next
    # test): the count rule is tested with memory to spare, whatever the machine has just now
    monkeypatch.setattr(warm, "memory_shortfall", lambda fraction: 0)
    monkeypatch.setattr(warm, "LOW_MEMORY_FRACTION", 0.0)  # nor do the hosts stop by themselves
    if env is None:
        monkeypatch.delenv(warm.IDLE_OTHERS_ENV, raising=False)
    else:
        monkeypatch.setenv(warm.IDLE_OTHERS_ENV, env)
    keep = warm.IDLE_OTHERS_CPU if env is None else int(env)
    names = "abcdefgh"[:keep + 1]
    _run(_answer(names[-1]))  # the last setting: used twice, first and last, so the most used
    for name in names:
        _run(_answer(name))
    assert len(set(warm._hosts().values())) == keep + 1
    _run(_answer("z"))  # "a" was used once and idle longest: it stops to make room
    deadline = time.monotonic() + 30
    while len(warm._hosts()) > keep + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    keys = set(warm._hosts().values())
    assert _key(_stage("a")) not in keys and _key(_stage("z")) in keys, keys
    assert _key(_stage(names[-1])) in keys and len(keys) == keep + 1


def _wait_hosts(count: int) -> set:
    deadline = time.monotonic() + 30
    while len(warm._hosts()) > count and time.monotonic() < deadline:
        time.sleep(0.2)
    return set(warm._hosts().values())


def test_where_memory_is_short_the_least_used_idle_hosts_stop_until_their_memory_makes_it_up(monkeypatch):
    """Short of memory, a new host stops idle hosts of other settings, the fewest leases first
    (here "b", leased once though most recently), only as many as hold the bytes missing; the
    engine most runs used ("a", leased three times) stays loaded. Missing more than they all
    hold, every idle host of other settings stops."""
    monkeypatch.setattr(warm, "memory_shortfall", lambda fraction: 0)
    monkeypatch.setattr(warm, "LOW_MEMORY_FRACTION", 0.0)  # (the suite's own engines beside it)
    for name in "aaab":
        _run(_answer(name))
    assert len(set(warm._hosts().values())) == 2
    monkeypatch.setattr(warm, "memory_shortfall", lambda fraction: 1 if fraction == warm.room_fraction() else 0)
    _run(_answer("z"))
    assert _wait_hosts(2) == {_key(_stage("a")), _key(_stage("z"))}
    monkeypatch.setattr(warm, "memory_shortfall", lambda fraction: 1 << 50 if fraction == warm.room_fraction() else 0)
    _run(_answer("y"))
    assert _wait_hosts(1) == {_key(_stage("y"))}


def test_the_room_a_new_host_wants_is_llmbatchs_share_or_the_one_set(monkeypatch):
    monkeypatch.delenv(warm.ROOM_ENV, raising=False)
    assert warm.room_fraction() == warm.ROOM_FRACTION
    monkeypatch.setenv(warm.ROOM_ENV, "0.2")
    assert warm.room_fraction() == 0.2
    for bad in ("most", "1.5", "-0.1"):
        monkeypatch.setenv(warm.ROOM_ENV, bad)
        with pytest.raises(ConfigError, match=warm.ROOM_ENV):
            warm.room_fraction()


def test_an_idle_host_short_of_memory_waits_longer_the_more_leases_it_served():
    assert engine_host.stops_for_memory(0.0, 0)  # never leased: at once
    assert not engine_host.stops_for_memory(engine_host.WATCH_EVERY_S * 2, 3)
    assert engine_host.stops_for_memory(engine_host.WATCH_EVERY_S * 3, 3)
    most = engine_host.WATCH_EVERY_S * engine_host.LOW_MEMORY_PATIENCE_LEASES
    assert engine_host.stops_for_memory(most, 1000) and not engine_host.stops_for_memory(most - 1, 1000)


def test_an_idle_host_stops_after_keep_warm_s():
    _run(_answer(keep_warm_s=1.0))
    assert warm._hosts()
    deadline = time.monotonic() + 30
    while warm._hosts() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not warm._hosts(), "the host should stop once idle for keep_warm_s"


def _lessee():
    """A replica that a driver's kill will end, as an actor, leasing in this test's Ray namespace
    of hosts (its process's module is not patched: the namespace is set there)."""
    import ray

    @ray.remote(num_cpus=0)
    class Lessee:
        def __init__(self, namespace: str):
            warm.NAMESPACE = namespace

        def lease(self) -> bool:  # a host, and no batch sent to it
            async def go():
                stage = _stage()
                self.host, self.token = await warm.lease([stage], _key(stage), 60.0, {})
            asyncio.run(go())
            return True

        def run(self) -> None:  # a batch that runs in its host for 120 s
            async def go():
                stage = warm.WarmEngineStage(_stage(delay_s=120.0), 60.0)
                stage.prepare()
                stage.begin()
                await stage.start()
                async for _ in stage([{"prompt": "slow"}]):
                    pass
            asyncio.run(go())

    return Lessee.remote(warm.NAMESPACE)


def test_a_host_whose_lessee_died_is_handed_to_the_next_run():
    import ray

    holder = _lessee()
    assert ray.get(holder.lease.remote())
    ray.kill(holder)  # a killed driver's replica: it never gives the host back
    start = time.monotonic()
    out = _run(_answer())
    assert len(out) == 3 and len(warm._hosts()) == 1, "the dead lessee's host, not a new one"
    assert time.monotonic() - start < engine_host.HANDOVER_WAIT_S + 20


def test_the_batch_of_a_lessee_that_died_is_cancelled_and_the_host_freed_without_a_next_run():
    import ray

    def leased() -> bool:
        names = list(warm._hosts())
        return bool(names) and ray.get(ray.get_actor(names[0], namespace=warm.NAMESPACE).state.remote())["leased"]

    holder = _lessee()
    holder.run.remote()  # its batch runs in the host for 120 s
    deadline = time.monotonic() + 60
    while not leased() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leased(), "the lessee's batch never reached a host"
    ray.kill(holder)  # a killed driver's replica, its batch still in the host's engine
    killed = time.monotonic()
    while leased() and time.monotonic() - killed < 40:
        time.sleep(0.5)
    assert not leased(), "the host kept running the batch of a lessee that died"
    assert time.monotonic() - killed < 5 * engine_host.WATCH_EVERY_S + 20


def test_a_lessee_that_idles_loses_its_host_to_the_next_run_and_leases_again():
    async def both():
        idle = warm.WarmEngineStage(_stage(), 60.0)
        idle.prepare()
        idle.begin()
        await idle.start()
        await asyncio.sleep(engine_host.TAKEOVER_IDLE_S + 1)
        other = await _answer()  # the idle lessee's host, handed over
        again = []
        async for chunk in idle([{"prompt": "later"}]):  # LeaseLost: it leases a host again
            again.extend(chunk)
        await idle.close()
        return other, again

    other, again = _run(both())
    assert len(other) == 3 and again[0]["generated_text"].endswith(":later")
    assert len(warm._hosts()) == 1, "one host served both"


def test_a_replica_never_takes_the_host_of_an_idle_peer_of_its_own_run():
    # a run's replicas wait for each other before their first batch (watchdog.wait_for_peers):
    # the first one's host idled past TAKEOVER_IDLE_S while the second leased, which took it,
    # and the run's replicas shared one engine (a fresh clone's suite: one replica answered all)
    async def peers(run_a: str, run_b: str):
        replicas = []
        for run in (run_a, run_b):
            replica = warm.WarmEngineStage(_stage(), 60.0)
            replica.run = run
            replica.prepare()
            replica.begin()
            await replica.start()
            replicas.append(replica)
            if len(replicas) == 1:
                await asyncio.sleep(engine_host.TAKEOVER_IDLE_S + 1)
        out = []
        for replica in replicas:
            async for chunk in replica([{"prompt": "x"}]):
                out.append(chunk[0]["generated_text"].split(":")[0])
            await replica.close()
        return out

    first, second = _run(peers("run-1", "run-1"))
    assert first != second and len(warm._hosts()) == 2, "each replica of the run on a host of its own"
    _stop_all_hosts()
    first, second = _run(peers("run-1", "run-2"))  # the next run's replica takes the idle one's host
    assert len(warm._hosts()) == 1, (first, second)


def test_a_host_busy_with_a_batch_is_kept_and_the_next_run_gets_another():
    async def both():
        busy = warm.WarmEngineStage(_stage(delay_s=60.0), 60.0)
        busy.prepare()
        busy.begin()
        await busy.start()

        async def drain():
            async for _ in busy([{"prompt": "slow"}]):
                pass

        running = asyncio.ensure_future(drain())
        await asyncio.sleep(1.0)
        try:
            return await _answer()
        finally:
            running.cancel()
            await busy.close()

    out = _run(both())
    assert len(out) == 3 and len(warm._hosts()) == 2, "the busy host kept, another one for the next run"


def test_an_engine_that_cannot_start_fails_the_lease_with_its_reason_and_its_host_stops():
    with pytest.raises(EngineStartError, match="told to fail"):
        _run(_answer(fail_start=True))
    deadline = time.monotonic() + 30
    while warm._hosts() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not warm._hosts()


def test_rows_of_a_host_that_died_mid_run_go_to_a_new_host():
    import ray

    async def go():
        proxy = warm.WarmEngineStage(_stage(delay_s=0.5), 60.0)
        proxy.prepare()
        proxy.begin()
        await proxy.start()
        first_host = proxy.host
        out = []
        killed = False
        async for chunk in proxy([{"prompt": f"p{i}"} for i in range(40)]):
            out.extend(chunk)
            if not killed:
                ray.kill(first_host)
                killed = True
        await proxy.close()
        return out

    out = _run(go())
    assert sorted(r["generated_text"].split(":")[2] for r in out) == sorted(f"p{i}" for i in range(40))
    assert len({r["generated_text"].split(":")[0] for r in out}) == 2, "rows from the first host and the new one"


def test_the_host_name_is_made_of_the_settings_digest():
    stage = _stage("z")
    assert _key(stage) == warm.warm_key(_stage("z"), {}) != warm.warm_key(_stage("y"), {})
    assert warm.warm_key(stage, {"num_gpus": 1}) != _key(stage)
    assert len(_key(stage)) == 16
