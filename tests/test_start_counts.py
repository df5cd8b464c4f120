"""The suite's start counts (tests/start_counts.py) from a ledger written by llmbatch.startlog."""

from __future__ import annotations

import json

import pytest
from start_counts import count_starts, format_counts


def test_starts_are_counted_per_file_and_warm_engines_stopped_are_named_with_why(tmp_path):
    folder = tmp_path / "kept"  # a folder the caller named: it stays, with the detail file
    folder.mkdir()
    lines = [{"kind": "vllm-engine", "t0": 10, "pid": 1, "phase": "begin"},
             {"kind": "vllm-engine", "t0": 10, "pid": 1, "seconds": 20.0, "ok": True},
             {"kind": "warm-host-stop", "t0": 40, "pid": 1, "seconds": 0.0, "why": "its machine short of memory",
              "engine": True},
             {"kind": "warm-host-stop", "t0": 41, "pid": 1, "seconds": 0.0, "why": "made room for another host",
              "engine": False},  # a host whose engine never started: nothing lost
             {"kind": "vllm-engine", "t0": 50, "pid": 2, "phase": "begin"},
             {"kind": "cli", "t0": 60, "pid": 3, "phase": "begin"}]
    (folder / "gw0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    phases = [("gw0", "tests/a.py", 0, 45), ("gw0", "tests/b.py", 45, 70)]
    table = count_starts(folder, phases, {"tests/a.py": 45.0, "tests/b.py": 25.0})
    assert table["tests/a.py"]["engines"] == 1 and table["tests/a.py"]["engine_s"] == 20.0
    assert table["tests/a.py"]["stops"] == 1 and table["tests/b.py"]["engines"] == 1 and table["tests/b.py"]["cli"] == 1
    text = "\n".join(format_counts(table))
    assert "engine cold starts: 2 (20 s starting), Ray clusters started: 0, CLI processes: 1" in text, text
    assert "warm engines stopped: 1 (its machine short of memory: 1)" in text, text
    detail = json.loads((folder / "starts-by-file.json").read_text())
    assert [d["kind"] for d in detail] == ["vllm-engine", "warm-host-stop", "warm-host-stop", "vllm-engine", "cli"]


def test_a_start_whose_first_steps_ran_before_its_block_is_timed_from_when_it_began(tmp_path, monkeypatch):
    """vLLM's engine imports what its start needs in begin(), before the timed block: the
    ledger's entry counts from begin() (``since``), so that the suite's "engine s" keep it."""
    import time

    from llmbatch import startlog

    ledger = tmp_path / "starts.jsonl"
    monkeypatch.setenv(startlog.ENV, str(ledger))
    began = time.time() - 5.0
    with startlog.timed("vllm-engine", since=began, model="m"):
        pass
    with startlog.timed("vllm-engine", since=time.time() + 60, model="m"):  # a time to come: ignored
        pass
    done = [json.loads(line) for line in ledger.read_text().splitlines() if "seconds" in line]
    assert abs(done[0]["t0"] - began) < 0.01 and 5.0 <= done[0]["seconds"] < 6.0, done
    assert done[1]["seconds"] < 1.0, done


def test_a_replica_attaching_to_the_engine_its_driver_launched_is_no_second_start(tmp_path):
    """The launcher's line is the engine's start; the replica's line says it attached (no start)
    or fell back to its own engine (a start, counted by the line's end, with its seconds)."""
    folder = tmp_path / "kept"
    folder.mkdir()
    lines = [{"kind": "vllm-engine", "t0": 1, "pid": 7, "phase": "begin", "launched_early": True},
             {"kind": "vllm-engine", "t0": 1, "pid": 7, "seconds": 25.0, "ok": True, "launched_early": True},
             {"kind": "vllm-engine", "t0": 5, "pid": 8, "phase": "begin", "attach": True},
             {"kind": "vllm-engine", "t0": 5, "pid": 8, "seconds": 22.0, "ok": True, "attach": True, "attached": True},
             {"kind": "vllm-engine", "t0": 40, "pid": 9, "phase": "begin", "attach": True},
             {"kind": "vllm-engine", "t0": 40, "pid": 9, "seconds": 30.0, "ok": True, "attach": True,
              "attached": False},  # the launched engine failed: the replica started its own
             {"kind": "vllm-engine", "t0": 80, "pid": 10, "phase": "begin", "attach": True}]  # killed mid-attach
    (folder / "gw0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    table = count_starts(folder, [("gw0", "tests/a.py", 0, 100)], {"tests/a.py": 100.0})
    assert table["tests/a.py"]["engines"] == 2 and table["tests/a.py"]["engine_s"] == 55.0, dict(table["tests/a.py"])


def test_a_command_line_that_exits_0_is_a_start_that_went_well(tmp_path, monkeypatch):
    """typer ends every command with SystemExit: code 0 is ok, any other code is not (the GPU
    ledger of a finished 10,000-row ``llmbatch run`` said ``ok: false``)."""
    from llmbatch import startlog

    ledger = tmp_path / "starts.jsonl"
    monkeypatch.setenv(startlog.ENV, str(ledger))
    for code in (0, None, 2):
        with pytest.raises(SystemExit), startlog.timed("cli", command="run"):
            raise SystemExit(code)
    done = [json.loads(line) for line in ledger.read_text().splitlines() if "seconds" in line]
    assert [d["ok"] for d in done] == [True, True, False], done
