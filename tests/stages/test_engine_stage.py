"""The engine stage's scheduling and error paths, with a fake engine (the real engine is
exercised in tests/e2e)."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from llmbatch.engines.base import Engine, Request
from llmbatch.errors import RowError, RowValidationError
from llmbatch.rows import ERROR_COLUMN, STATS
from llmbatch.stages.engine import EngineStage


class EngineDied(Exception):
    pass


class FakeEngine(Engine):
    def __init__(self, die_on: set[str] | None = None, die_times: int = 1):
        self.capacity = 8
        self.calls: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.starts = 0
        self.die_on = die_on or set()
        self.die_times = die_times

    async def start(self):
        self.starts += 1

    async def restart(self):
        await self.start()

    async def close(self):
        pass

    def is_fatal(self, exc):
        return isinstance(exc, EngineDied)

    def build_request(self, row):
        if row["prompt"] == "bad":
            raise RowValidationError("unknown sampling param 'max_token' (did you mean 'max_tokens'?)")
        key = (row["prompt"],) if row.get("greedy", True) else None
        return Request(prompt=row["prompt"], params=None, key=key, sort_key=row["prompt"],
                       extra={"delay": row.get("delay", 0.01)})

    async def run(self, request):
        self.calls.append(request.prompt)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(request.extra["delay"])
            if request.prompt in self.die_on and self.die_times > 0:
                self.die_times -= 1
                raise EngineDied("engine core died")
            if request.prompt == "boom":
                raise ValueError("the engine rejected this request")
            return {"generated_text": request.prompt.upper(), "num_input_tokens": 1, "num_generated_tokens": 1,
                    "prompt": request.prompt, "finish_reason": "stop", "time_taken_llm": 0.0, "request_id": 0,
                    "generated_tokens": [1], "num_cached_tokens": 0}
        finally:
            self.in_flight -= 1


def run_stage(stage, rows):
    async def go():
        await stage.start()
        chunks = []
        async for chunk in stage(rows):
            chunks.append((time.monotonic(), [r["prompt"] for r in chunk]))
        return chunks

    return asyncio.run(go())


def answer_all(stage, rows) -> list:
    """Every row ``stage`` gives back for ``rows``, started first."""
    async def go():
        await stage.start()
        return [row async for chunk in stage(rows) for row in chunk]

    return asyncio.run(go())


def test_rows_stream_out_before_a_slow_row_finishes():
    rows = [{"prompt": f"p{i}", "delay": 0.01} for i in range(8)] + [{"prompt": "slow", "delay": 1.0}]
    stage = EngineStage(FakeEngine(), flush_rows=4, flush_seconds=0.1)
    start = time.monotonic()
    chunks = run_stage(stage, rows)
    fast = [t for t, names in chunks if "slow" not in names]
    assert fast and all(t - start < 0.6 for t in fast)
    assert sorted(p for _, names in chunks for p in names) == sorted(r["prompt"] for r in rows)


def test_identical_requests_run_once_and_fan_out():
    engine = FakeEngine()
    rows = [{"prompt": "same"} for _ in range(5)] + [{"prompt": "other"}]
    out = answer_all(EngineStage(engine), rows)
    assert engine.calls.count("same") == 1
    assert len(out) == 6 and all(r["generated_text"] == r["prompt"].upper() for r in out)
    assert sum(r[STATS]["deduped"] for r in out) == 4


def test_rows_whose_request_was_answered_before_leave_first_without_reaching_the_engine():
    engine = FakeEngine()
    stage = EngineStage(engine)
    first = [{"prompt": "same"}, {"prompt": "other"}]
    later = [{"prompt": "new", "delay": 0.2}] + [{"prompt": p} for p in ("same", "other", "same")]

    async def go():
        await stage.start()
        async for _ in stage(first):
            pass
        return [chunk async for chunk in stage(later)]

    chunks = asyncio.run(go())
    assert engine.calls == ["other", "same", "new"]  # sorted by prompt in the first batch
    # the copies come out at once, in one chunk, before the batch's new request is answered
    assert [r["prompt"] for r in chunks[0]] == ["same", "other", "same"]
    assert all(r[STATS]["deduped"] and r["generated_text"] == r["prompt"].upper() for r in chunks[0])
    assert [r["prompt"] for r in chunks[1]] == ["new"] and not chunks[1][0][STATS]["deduped"]


def test_random_sampling_is_not_deduplicated():
    engine = FakeEngine()
    rows = [{"prompt": "same", "greedy": False} for _ in range(3)]
    run_stage(EngineStage(engine), rows)
    assert engine.calls.count("same") == 3


def test_dedup_can_be_switched_off():
    engine = FakeEngine()
    run_stage(EngineStage(engine, dedup_requests=False), [{"prompt": "same"} for _ in range(3)])
    assert engine.calls.count("same") == 3


def test_pending_requests_are_bounded():
    engine = FakeEngine()
    rows = [{"prompt": f"p{i}", "delay": 0.05} for i in range(20)]
    run_stage(EngineStage(engine, max_pending_requests=3), rows)
    assert engine.max_in_flight == 3


def test_sorted_by_prompt_when_asked():
    engine = FakeEngine()
    rows = [{"prompt": p} for p in ["b2", "a1", "b1", "a2"]]
    run_stage(EngineStage(engine, max_pending_requests=1), rows)
    assert engine.calls == ["a1", "a2", "b1", "b2"]


def test_dead_engine_is_restarted_and_rows_retried():
    engine = FakeEngine(die_on={"p1"}, die_times=1)
    rows = [{"prompt": f"p{i}"} for i in range(4)]
    out = answer_all(EngineStage(engine), rows)
    assert engine.starts == 2
    assert all(r[ERROR_COLUMN] == "" for r in out) and len(out) == 4


def test_the_request_tally_counts_every_request_handed_the_engine_retries_included(tmp_path, monkeypatch):
    # the benchmarks' count of requests that reached the engine across a kill (bench/industry_gpu.py):
    # one byte per request, written before the engine has it, copies of identical rows not counted
    monkeypatch.setenv("LLMBATCH_REQUEST_TALLY_DIR", str(tmp_path / "tally"))
    engine = FakeEngine(die_on={"p1"}, die_times=1)
    rows = [{"prompt": f"p{i}"} for i in range(4)] + [{"prompt": "p0"}, {"prompt": "p2"}]
    out = answer_all(EngineStage(engine), rows)
    files = list((tmp_path / "tally").iterdir())
    assert len(out) == 6 and len(engine.calls) == 5  # p0..p3 once each, p1 again after the engine died
    assert len(files) == 1 and files[0].stat().st_size == len(engine.calls), files


class DigestEngine(FakeEngine):
    """Requests keyed by a digest, as vLLM's are (the key answer records are made for)."""

    def build_request(self, row):
        request = super().build_request(row)
        request.key = hashlib.sha256(row["prompt"].encode()).digest()[:16]
        return request


def test_each_answer_goes_to_the_journal_as_it_is_made_and_copies_do_not(tmp_path):
    from llmbatch.rows import ANSWER
    from llmbatch.stages.answers import read_record

    journal = tmp_path / "answers"
    journal.mkdir()
    engine = DigestEngine()
    stage = EngineStage(engine, flush_rows=1)
    stage.seed(None, "tag", str(journal))
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "a"}, {"prompt": "slow", "delay": 1.0}]
    seen = []

    async def go():
        await stage.start()
        async for chunk in stage(rows):
            for row in chunk:
                # written before the row leaves the stage: a kill after this loses nothing
                lines = [line for f in journal.iterdir() for line in f.read_text().splitlines()]
                seen.append((row["prompt"], len(lines), row.get(ANSWER) is not None))

    asyncio.run(go())
    files = list(journal.iterdir())
    lines = files[0].read_text().splitlines()
    assert len(files) == 1 and len(lines) == 3  # a, b, slow: the copy of a is not an answer made
    found = dict(read_record(line, "tag") for line in lines)
    assert {v["generated_text"] for v in found.values()} == {"A", "B", "SLOW"}
    assert all(count >= 1 for _, count, _ in seen) and ("slow", 3, True) in seen
    assert sorted(recorded for _, _, recorded in seen) == [False, True, True, True]  # the rows carry theirs too
    # a replica that cannot see the folder (another machine) keeps no journal and still answers
    other = EngineStage(DigestEngine())
    other.seed(None, "tag", str(tmp_path / "elsewhere"))
    out = run_stage(other, [{"prompt": "c"}])
    assert out and not (tmp_path / "elsewhere").exists()


def test_the_journal_is_bounded_a_replica_keeps_its_current_file_and_the_one_before(tmp_path, monkeypatch):
    from llmbatch.stages import answers
    from llmbatch.stages.answers import read_record

    monkeypatch.setattr(answers, "JOURNAL_FILE_BYTES", 400)  # about two answers a file
    journal = tmp_path / "answers"
    journal.mkdir()
    stage = EngineStage(DigestEngine())
    stage.seed(None, "tag", str(journal))
    run_stage(stage, [{"prompt": f"p{i}"} for i in range(12)])
    files = list(journal.iterdir())
    lines = [line for f in files for line in f.read_text().splitlines()]
    assert 1 <= len(files) <= 2 and sum(f.stat().st_size for f in files) <= 2 * 400 + 300, files
    kept = {v["generated_text"] for v in dict(read_record(line, "tag") for line in lines).values()}
    assert len(kept) >= 2 and kept < {f"P{i}" for i in range(12)}  # the oldest files dropped


def test_engine_that_keeps_dying_gives_error_rows_after_bounded_attempts():
    engine = FakeEngine(die_on={"p1"}, die_times=99)
    out = answer_all(EngineStage(engine, max_attempts=3), [{"prompt": "p0"}, {"prompt": "p1"}])
    by = {r["prompt"]: r for r in out}
    assert by["p0"][ERROR_COLUMN] == ""
    assert by["p1"][ERROR_COLUMN].startswith("engine: EngineDiedError: the engine died 3 times")
    assert engine.starts == 3


def test_bad_rows_become_error_rows_or_raise():
    rows = [{"prompt": "bad"}, {"prompt": "boom"}, {"prompt": "fine"}]
    out = []

    async def go(stage):
        await stage.start()
        async for chunk in stage([dict(r) for r in rows]):
            out.extend(chunk)

    asyncio.run(go(EngineStage(FakeEngine())))
    by = {r["prompt"]: r[ERROR_COLUMN] for r in out}
    assert by["bad"].startswith("validate: RowValidationError: unknown sampling param 'max_token'")
    assert by["boom"] == "engine: ValueError: the engine rejected this request"
    assert by["fine"] == ""
    # without continue_on_error, the runner fails the run at the first error row, naming it
    import pyarrow as pa

    from llmbatch.stages.runner import StageRunner

    runner = StageRunner([EngineStage(FakeEngine())], continue_on_error=False)
    with pytest.raises(RowError, match="RowValidationError.*row .*bad"):
        list(runner(pa.table({"prompt": [r["prompt"] for r in rows]})))


def test_missing_prompt_names_the_keys():
    out = answer_all(EngineStage(FakeEngine()), [{"messages": []}])
    assert "needs 'tokenized_prompt or prompt'" in out[0][ERROR_COLUMN]


def test_structured_output_check():
    from llmbatch.errors import StructuredOutputError
    from llmbatch.stages.check_output import check_structured

    check_structured({"choice": ["A", "Construction"]}, "Construction", "length")  # complete, only EOS cut
    check_structured({"regex": r"\d{3}"}, "123", "stop")
    check_structured({"json": {"type": "object", "required": ["a"]}}, '{"a": 1}', "stop")
    with pytest.raises(StructuredOutputError, match="not one of the choices"):
        check_structured({"choice": ["A"]}, "B", "stop")
    with pytest.raises(StructuredOutputError, match="stopped at max_tokens"):
        check_structured({"json": {"type": "object"}}, '{"a": ', "length")
    with pytest.raises(StructuredOutputError, match="does not match the JSON schema"):
        check_structured({"json": {"type": "object", "required": ["a"]}}, '{"b": 1}', "stop")


def test_dedup_cache_is_bounded_by_bytes_and_keyed_by_digest():
    from llmbatch.engines.vllm_params import request_digest
    from llmbatch.stages.engine import result_size

    long_prompt = list(range(50_000))
    key = request_digest(long_prompt, {"temperature": 0}, None)
    assert len(key) == 16 and key == request_digest(list(long_prompt), {"temperature": 0}, None)
    assert key != request_digest(long_prompt, {"temperature": 0}, "adapter-a")
    assert key != request_digest("text prompt", {"temperature": 0}, None)
    stage = EngineStage(FakeEngine())
    stage.result_cache_bytes = 1 << 20
    answer = {"generated_text": "x" * 2000, "generated_tokens": list(range(500))}
    for i in range(2000):
        stage._remember(request_digest([i], {}, None), dict(answer))
    assert stage._results_bytes <= stage.result_cache_bytes
    assert 0 < len(stage._results) < 2000 and stage._results_bytes == sum(s for _, s in stage._results.values())
    assert result_size(answer) > 6000


def test_job_sink_keeps_the_error_column_with_postprocess_and_errors_not_kept():
    import pyarrow as pa

    from llmbatch.codec import decode_rows
    from llmbatch.rows import ROW_ID
    from llmbatch.stages.runner import StageRunner
    from llmbatch.stages.output import OutputStage
    from llmbatch.stages.user_fns import PostprocessStage

    rows = pa.table({ROW_ID: [0, 1], "generated_text": ["a", "b"], ERROR_COLUMN: ["", ""]})
    post = PostprocessStage(lambda row: {"answer": row["generated_text"]})
    job_output = OutputStage(keep_private=(ROW_ID,), for_job=True).bind(task_type="generate", continue_on_error=False,
                                                                         postprocessed=True)
    job_sink = StageRunner([post, job_output], continue_on_error=False)
    out = [r for t in job_sink(rows) for r in decode_rows(t)]
    assert [(r["answer"], r[ERROR_COLUMN], r[ROW_ID]) for r in out] == [("a", "", 0), ("b", "", 1)]
    user_output = OutputStage().bind(task_type="generate", continue_on_error=False, postprocessed=True)
    user_sink = StageRunner([post, user_output], continue_on_error=False)
    assert all(ERROR_COLUMN not in t.column_names for t in user_sink(rows))
