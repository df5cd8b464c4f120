"""Live progress: rates over the recent window, generated vs delivered tokens, progress.json."""

from __future__ import annotations

import json
import time

from llmbatch.progress import Progress, fmt_duration


def test_rates_counts_and_the_status_file(tmp_path):
    path = tmp_path / "progress.json"
    p = Progress(100, done_before=10, errors_before=2, progress_path=path, tty=False, quiet=True)
    p.add(ok=20, errors=1, in_tokens=500, generated_tokens=100, delivered_tokens=160, deduped=3,
          error_types={"engine: X": 1}, replicas={"r1": 21})
    time.sleep(0.2)
    snap = p.snapshot()
    assert snap["rows_done"] == 31 and snap["rows_error"] == 3 and snap["rows_ok"] == 28
    assert snap["generated_tokens_per_s"] > 0 and snap["delivered_tokens_per_s"] > snap["generated_tokens_per_s"]
    assert snap["eta_s"] is not None and snap["error_types"] == {"engine: X": 1}
    line = p.line(snap)
    assert "generated" in line and "delivered" in line and "31/100" in line
    p.tick()
    assert json.loads(path.read_text())["rows_done"] == 31
    assert not list(tmp_path.glob(".*.tmp"))
    final = p.stop("finished")
    assert final["state"] == "finished" and json.loads(path.read_text())["state"] == "finished"


def test_before_the_first_row_it_says_the_engine_is_starting():
    p = Progress(10, tty=False, quiet=True)
    assert "starting" in p.line(p.snapshot())


def test_durations():
    assert fmt_duration(None) == "?" and fmt_duration(42) == "42s" and fmt_duration(125) == "2m05s"
    assert fmt_duration(3 * 3600 + 60) == "3h01m"


def test_the_start_up_phase_is_shown_and_written_for_status(tmp_path, monkeypatch):
    """Before the first answer the live view and progress.json say what the run is doing:
    starting Ray, placing replicas, then what the replicas' heartbeats say."""
    import llmbatch.progress as progress_mod

    path = tmp_path / "progress.json"
    p = Progress(8, progress_path=path, tty=False, quiet=True)
    p.set_phase("starting Ray")
    assert "starting: starting Ray" in p.line(p.snapshot())
    p.watch_replicas("run-1")
    beats = []
    monkeypatch.setattr(progress_mod, "read_heartbeats", lambda run_id: list(beats))
    monkeypatch.setattr(progress_mod, "BEATS_EVERY_S", 0.0)
    p.tick()
    assert json.loads(path.read_text())["phase"] == "placing replicas"
    beats.append({"state": "starting", "at": time.time()})
    p.tick()
    assert json.loads(path.read_text())["phase"] == "loading the model"
    beats[0] = {"state": "ready", "at": time.time()}
    p.tick()
    assert json.loads(path.read_text())["phase"] == "waiting for the first answer"
    p.add(ok=2, errors=0, in_tokens=20, generated_tokens=4)
    p.tick()
    assert json.loads(path.read_text())["phase"] == "answering"


def test_the_last_frame_and_the_summary_show_one_set_of_figures():
    """Once the run is over, the rates are the whole run's ("since start"), the same however
    late they are read (the live view's last frame, stats.json, status)."""
    from rich.console import Console

    from llmbatch.progress import rates_text

    p = Progress(6, tty=False, quiet=True)
    p.started -= 10  # a run that began 10 s ago
    p.add(ok=5, errors=1, in_tokens=300, generated_tokens=60, delivered_tokens=60)
    final = p.stop("finished")
    assert final["window"] == "since start" and final["rows_per_s"] > 0
    assert abs(final["rows_per_s"] - 6 / final["window_s"]) <= 0.01 * final["rows_per_s"] + 1e-3
    later = p.snapshot()
    assert later["rows_per_s"] == final["rows_per_s"] and later["generated_tokens_per_s"] == final["generated_tokens_per_s"]
    console = Console(record=True, width=120)
    console.print(p._table(later))
    frame = console.export_text()
    assert rates_text(later) in " ".join(frame.split()), frame
    assert "since start" in rates_text(later) and "generated" in rates_text(later)


def test_pooling_tasks_report_items_not_generated_tokens():
    from llmbatch.progress import rates_text

    p = Progress(4, tty=False, quiet=True, task="embed")
    p.started -= 10
    p.add(ok=3, errors=1, in_tokens=40, generated_tokens=0)
    running = rates_text(p.snapshot())
    final = rates_text(p.stop("finished"))
    for text in (running, final):
        assert "rows/s" in text and "items/s (embeddings)" in text and "generated" not in text, text


def test_without_a_terminal_the_last_line_shows_the_runs_figures(capsys):
    p = Progress(3, tty=False, log_every=3600)
    p.started -= 10
    p.start()
    p.add(ok=3, errors=0, in_tokens=30, generated_tokens=9)
    p.stop("finished")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "3/3 rows" in last and "since start" in last, last
