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
