"""StageRunner: the output shapes of the last operator, and its heartbeat."""

from __future__ import annotations

import pyarrow as pa
import pytest

from llmbatch.codec import STATE_COLUMN, decode_rows
from llmbatch.rows import ERROR_COLUMN, ROW_ID, STATS
from llmbatch.stages.base import Stage
from llmbatch.stages.output import OutputStage
from llmbatch.stages.runner import StageRunner


class Answer(Stage):
    name = "engine"

    def process_row(self, row):
        if row["q"] == "bad":
            raise ValueError("cannot answer")
        row.update(generated_text=row["q"].upper(), num_input_tokens=1, num_generated_tokens=1,
                   sampling_params={"max_tokens": 1}, **{STATS: {"replica": "r"}})


def run(runner, table):
    return list(runner(table))


def test_user_sink_gives_typed_columns_without_request_fields():
    runner = StageRunner([Answer(), OutputStage()], continue_on_error=True)
    out = pa.concat_tables(run(runner, pa.table({"q": ["a", "bad"], "keep": [1, 2]})))
    rows = out.to_pylist()
    assert "sampling_params" not in out.column_names and STATS not in out.column_names
    assert rows[0]["generated_text"] == "A" and rows[0]["keep"] == 1 and rows[0][ERROR_COLUMN] == ""
    assert rows[1][ERROR_COLUMN] == "engine: ValueError: cannot answer" and rows[1]["finish_reason"] == "error"


def test_middle_operators_pass_encoded_rows_and_the_job_sink_keeps_its_private_columns():
    middle = StageRunner([Answer()], continue_on_error=True)
    (table,) = run(middle, pa.table({"q": ["a"], ROW_ID: [7]}))
    assert table.column_names == [STATE_COLUMN]
    job_sink = StageRunner([OutputStage(keep_private=(ROW_ID, STATS), for_job=True)])
    (out,) = run(job_sink, table)
    (row,) = decode_rows(out)
    assert row[ROW_ID] == 7 and row[STATS] == {"replica": "r"} and row["generated_text"] == "A"


def test_a_worker_hides_its_start_up_heap_from_the_collector():
    import gc

    before = gc.get_freeze_count()
    StageRunner([Answer()])  # the caller's process (this test's) is left alone by default
    assert gc.get_freeze_count() == before
    try:
        runner = StageRunner([Answer()], freeze_heap=True)  # a processor's worker (processor.py)
        assert gc.get_freeze_count() > before
        assert runner._probe()["state"] == "ready"
    finally:
        gc.unfreeze()


def test_heartbeat_probe_says_ready_after_start():
    runner = StageRunner([Answer()])
    assert runner._probe() == {"state": "ready", "waiting_since": 0.0, "in_flight": 0, "done": 0}


class Recording(Stage):
    """A stage that notes its begin() in a shared list."""
    label = ""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def begin(self):
        self.events["order"].append(f"{self.label} begin")


class SlowEngine(Recording):
    """An engine whose start lasts until the CPU stage beside it has loaded."""
    name = "engine"
    label = "engine"
    starts_engine = True

    async def start(self):
        self.events["engine started"].set()
        assert self.events["cpu loaded"].wait(10), "the CPU stage did not load while the engine started"
        self.events["order"].append("engine ready")


class LoadingStage(Recording):
    name = "multimodal"
    label = "cpu"

    async def start(self):
        assert self.events["engine started"].wait(10), "the engine's start did not begin beside this one"
        self.events["order"].append("cpu loaded")
        self.events["cpu loaded"].set()


def test_the_engine_starts_while_the_cpu_stages_load():
    """A replica's engine start (vLLM's own set-up) and the CPU stages' loading (a multimodal
    stage's model config and tokenizer) run side by side, not one after the other; begin()
    runs first, the engine's before the others'."""
    import threading

    events = {"order": [], "engine started": threading.Event(), "cpu loaded": threading.Event()}
    StageRunner([LoadingStage(events), SlowEngine(events)])
    assert events["order"] == ["engine begin", "cpu begin", "cpu loaded", "engine ready"]


def test_cpu_workers_without_an_engine_skip_begin():
    """begin() imports what starts running side by side share (the multimodal stage: vLLM's
    AsyncLLM too); CPU workers with no engine start their stages alone and skip it."""
    import threading

    events = {"order": [], "engine started": threading.Event(), "cpu loaded": threading.Event()}
    events["engine started"].set()  # no engine beside: LoadingStage must not wait for one
    StageRunner([LoadingStage(events), Answer()])
    assert events["order"] == ["cpu loaded"]


def test_a_cpu_stage_that_cannot_load_fails_the_replica_with_its_reason():
    import pytest

    class Broken(Stage):
        async def start(self):
            raise ValueError("no model config")

    with pytest.raises(ValueError, match="no model config"):
        StageRunner([Broken(), Answer()])


def test_a_batchs_cpu_work_does_not_hold_back_the_engine_requests_of_another():
    """The stages' synchronous work (decode, parse, template, tokenize) runs beside the loop,
    not on it: while one batch is in its CPU stage, another batch's requests go to the engine
    and come back (on the loop, vLLM's AsyncLLM takes requests and hands out outputs)."""
    import asyncio
    import threading
    import time

    marks = {}

    class Cpu(Stage):
        name = "preprocess"

        def process_row(self, row):
            if row["q"].startswith("slow"):
                time.sleep(0.4)  # like PIL decoding an image: C work
                marks["slow cpu done"] = time.monotonic()

    class Engine(Stage):
        name = "engine"

        async def __call__(self, rows):
            await asyncio.sleep(0.05)  # the engine (another process) answers
            for row in rows:
                row.update(generated_text=row["q"], num_input_tokens=1, num_generated_tokens=1)
            marks.setdefault(f"{rows[0]['q']} answered", time.monotonic())
            yield rows

    runner = StageRunner([Cpu(), Engine(), OutputStage()])
    fast = threading.Thread(target=run, args=(runner, pa.table({"q": ["fast"]})))
    fast.start()
    time.sleep(0.01)
    run(runner, pa.table({"q": ["slow1", "slow2", "slow3"]}))
    fast.join()
    assert marks["fast answered"] < marks["slow cpu done"] - 0.5, marks


def test_a_batch_on_its_way_to_the_engine_passes_batches_waiting_for_their_first_stage():
    """On the CPU thread later stages go first: with many batches in flight, the first one
    reaches the engine after its own stages' work, not after every batch's first stage."""
    import threading
    import time

    order = []

    class Decode(Stage):
        name = "preprocess"

        def process_batch(self, rows):
            time.sleep(0.05)
            order.append(f"decode {rows[0]['q']}")

    class Template(Stage):
        name = "chat_template"

        def process_batch(self, rows):
            order.append(f"template {rows[0]['q']}")

    runner = StageRunner([Decode(), Template(), Answer(), OutputStage()])
    threads = [threading.Thread(target=run, args=(runner, pa.table({"q": [f"b{i}"]}))) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.005)
    for t in threads:
        t.join()
    assert order.index("template b0") < order.index("decode b3"), order


@pytest.mark.parametrize("cores", [16, 2])
def test_a_process_with_the_cpu_thread_hands_the_gil_to_the_loop_within_a_fraction_of_a_millisecond(monkeypatch, cores):
    """Beside the CPU thread, the engine's loop waits for the GIL at each wake-up for up to the
    switch interval (5 ms by default: a convoy, see stages/base.py and bench/loop_gil.py); a
    process that starts the thread lowers it where it has the cores (not on 2)."""
    import sys

    from llmbatch.stages import base

    monkeypatch.setattr(base, "_CPU_THREAD", None)  # this process's thread, started afresh
    monkeypatch.setattr(base, "_usable_cores", lambda: cores)
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        runner = StageRunner([Answer(), OutputStage()])
        assert run(runner, pa.table({"q": ["a"]}))[0].column("generated_text").to_pylist() == ["A"]
        want = base.SWITCH_INTERVAL_S if cores >= base.SWITCH_MIN_CORES else 0.005
        assert sys.getswitchinterval() == pytest.approx(want, rel=1e-3)
    finally:
        sys.setswitchinterval(before)


class Batches(Stage):
    """Notes the size of every call; fails a row whose q is 'bad' (its own error)."""
    name = "engine"

    def __init__(self):
        super().__init__()
        self.calls = []

    def process_batch(self, rows):
        self.calls.append(len(rows))
        for row in rows:
            row["generated_text"] = str(row["q"]).upper()


def test_a_block_of_several_batches_reaches_each_stage_a_batch_at_a_time():
    stage = Batches()
    runner = StageRunner([stage], continue_on_error=True, batch_rows=4)
    tables = run(runner, pa.table({"q": [f"q{i}" for i in range(10)], ROW_ID: list(range(10))}))
    rows = [r for t in tables for r in decode_rows(t)]
    assert sorted(stage.calls) == [2, 4, 4]  # batches of batch_rows, the last one short
    assert sorted(r[ROW_ID] for r in rows) == list(range(10))  # every row once
    assert all(r["generated_text"] == r["q"].upper() for r in rows)


def test_a_failing_batch_of_a_block_fails_the_call():
    class Boom(Stage):
        name = "engine"

        async def __call__(self, rows):
            if rows[0]["q"] == "q4":
                raise RuntimeError("engine gone")
            yield rows

    runner = StageRunner([Boom()], continue_on_error=True, batch_rows=4)
    with pytest.raises(RuntimeError, match="engine gone"):
        run(runner, pa.table({"q": [f"q{i}" for i in range(10)]}))
