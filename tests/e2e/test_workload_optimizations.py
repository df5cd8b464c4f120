"""Dedup and prefix ordering are invisible in the answers: same ids, same greedy answers as
a run with both switched off, each row once; and the job reports what they saved."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.e2e


def run_job(tmp_path, name: str, dedup: bool, sort: bool) -> dict:
    out = tmp_path / f"{name}.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "llmbatch", "run", "--input", str(tmp_path / "in.jsonl"), "--id-column", "id",
         "--model", "smollm2-135m-instruct", "--prompt", "{question}", "--max-tokens", "12",
         "--temperature", "0", "--output", str(out), "--quiet",
         "--set", f"model.dedup_requests={str(dedup).lower()}", "--set", f"model.sort_by_prefix={str(sort).lower()}",
         "--set", "model.batch_size=16"],
        capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    table = pq.read_table(out)
    stats = json.loads((tmp_path / f"{name}.parquet.job" / "stats.json").read_text())
    return {"answers": dict(zip(table.column("id").to_pylist(), table.column("generated_text").to_pylist())),
            "stats": stats}


def test_dedup_and_ordering_never_change_answers(ray_cluster, smollm2, tmp_path):
    rng = random.Random(3)
    base = [f"Name a color that rhymes with {w}." for w in ["bed", "blue", "yellow", "pink", "red", "green"]]
    base += [f"Shared preamble for every customer question. Question {i}: what is {i} plus {i}?" for i in range(10)]
    rows = [{"id": i, "question": rng.choice(base)} for i in range(64)]  # heavy repetition, shared prefixes
    with open(tmp_path / "in.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    on = run_job(tmp_path, "on", dedup=True, sort=True)
    off = run_job(tmp_path, "off", dedup=False, sort=False)
    assert sorted(on["answers"]) == sorted(off["answers"]) == list(range(64))
    assert on["answers"] == off["answers"]
    by_question: dict[str, set] = {}
    for r in rows:
        by_question.setdefault(r["question"], set()).add(on["answers"][r["id"]])
    assert all(len(v) == 1 for v in by_question.values())  # identical requests, identical answers
    assert on["stats"]["dedup_ratio"] >= 0.5 and on["stats"]["deduplicated_rows"] >= 32
    assert off["stats"]["dedup_ratio"] == 0.0
    for run in (on, off):
        assert 0.0 <= run["stats"]["prefix_cache_hit_rate"] <= 1.0
        assert run["stats"]["rows_error"] == 0
