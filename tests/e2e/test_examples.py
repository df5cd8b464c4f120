"""Every example in examples/ runs (on a few rows) with the real engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def sample_csv(tmp_path_factory):
    from llmbatch.sample_data import write_customers_csv

    return write_customers_csv(tmp_path_factory.mktemp("examples") / "customers.csv", 60, seed=3)


def run_cli(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "llmbatch", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=cwd, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_every_example_is_covered():
    jobs = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != "notes.py")
    assert jobs == ["industry.yaml", "welcome_notes.yaml"]
    # openai_endpoint.py runs in test_http_vllm.py (against vllm serve), shared_engine.py in test_serve.py
    assert scripts == ["openai_endpoint.py", "quickstart.py", "shared_engine.py"]


def test_industry_example(ray_cluster, smollm2, sample_csv, tmp_path):
    out = tmp_path / "industries.parquet"
    proc = run_cli("run", str(EXAMPLES / "industry.yaml"), "--quiet", "--report", "--set", f"input.path={sample_csv}",
                   "--set", "input.limit=12", "--set", f"output.path={out}")
    assert "12 answered" in proc.stdout and "report" in proc.stdout
    png = tmp_path / "industries.parquet.job" / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = pq.read_table(out)
    assert table.column_names == ["Index", "Company", "industry"]
    assert sorted(int(i) for i in table.column("Index").to_pylist()) == list(range(1, 13))
    import yaml

    choices = yaml.safe_load((EXAMPLES / "industry.yaml").read_text())["prompt"]["choices"]
    assert all(v in choices for v in table.column("industry").to_pylist())


def test_welcome_notes_example(ray_cluster, smollm2, sample_csv, tmp_path):
    out = tmp_path / "notes.jsonl"
    run_cli("run", str(EXAMPLES / "welcome_notes.yaml"), "--quiet", "--set", f"input.path={sample_csv}",
            "--set", "input.limit=8", "--set", f"output.path={out}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["Index"] for r in rows) == [str(i) for i in range(1, 9)]
    assert all(set(r) == {"Index", "email", "note", "tokens"} and r["note"] and 0 < r["tokens"] <= 40 for r in rows)


def test_quickstart_script(ray_cluster, smollm2, sample_csv):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py"), str(sample_csv)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "60 rows" in proc.stdout
