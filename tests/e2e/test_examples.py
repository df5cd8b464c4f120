"""Every example in examples/ runs (on a few rows) with the real engine.

Each run starts an engine (a minute of the suite on a 2-core machine), so each example runs
once: resuming a job after a lost part is tested in test_tasks.py (a pooling job) and
test_jobs.py (kills at several points), not again here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from inproc import llmbatch

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def sample_csv(tmp_path_factory):
    from llmbatch.sample_data import write_customers_csv

    return write_customers_csv(tmp_path_factory.mktemp("examples") / "customers.csv", 60, seed=3)


def run_cli(*args):
    """The CLI in this process (tests/e2e/inproc.py): what the example's job does."""
    proc = llmbatch(*args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def run_cli_process(*args, env=None):
    """The CLI as its own process: the industry example's phases count from the process's start."""
    proc = subprocess.run([sys.executable, "-m", "llmbatch", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_every_example_is_covered():
    jobs = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != "notes.py")
    assert jobs == ["classify.yaml", "embed.yaml", "industry.yaml", "score.yaml", "welcome_notes.yaml"]
    # openai_endpoint.py runs in test_http_vllm.py (against vllm serve), shared_engine.py in test_serve.py;
    # score.yaml and classify.yaml in test_tasks.py, beside the other pooling jobs (the same models:
    # their warm engines serve both); embed.yaml here, on the worker of the other files of its engine
    assert scripts == ["captioning.py", "openai_endpoint.py", "quickstart.py", "shared_engine.py", "vision_qa.py"]


def test_industry_example(ray_cluster, smollm2, sample_csv, tmp_path):
    out = tmp_path / "industries.parquet"
    # an engine of its own (no warm one): the phases below include a model load
    proc = run_cli_process("run", str(EXAMPLES / "industry.yaml"), "--quiet", "--report", "--set", f"input.path={sample_csv}",
                   "--set", "input.limit=12", "--set", f"output.path={out}", "--set", "model.keep_warm_s=0",
                   env={"LLMBATCH_RAY_BESIDE_INPUT_BYTES": "0"})
    assert "12 answered" in proc.stdout and "report" in proc.stdout
    png = tmp_path / "industries.parquet.job" / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = pq.read_table(out)
    assert table.column_names == ["Index", "Company", "industry"]
    assert sorted(int(i) for i in table.column("Index").to_pylist()) == list(range(1, 13))
    import yaml

    choices = yaml.safe_load((EXAMPLES / "industry.yaml").read_text())["prompt"]["choices"]
    assert all(v in choices for v in table.column("industry").to_pylist())
    # where the CLI process's time went, phase by phase, each one measured
    stats = json.loads((tmp_path / "industries.parquet.job" / "stats.json").read_text())
    phases = stats["phases_s"]
    steps = ["process", "prepare_job", "ray_start", "replica_placement", "engine_start", "first_answer", "rows", "output"]
    assert all(phases[k] is not None and phases[k] >= 0 for k in steps + ["ingest", "to_first_row", "total"]), phases
    assert phases["engine_start"] > 0.5 and phases["process"] > 0.1, phases  # a model load, Python's imports
    assert abs(sum(phases[k] for k in steps) - phases["total"]) < 0.5, phases
    # Ray's start ran beside the input's read (as for a large input: LLMBATCH_RAY_BESIDE_INPUT_BYTES=0
    # here): its own length is measured, and the wait after the preparation is at most that
    assert phases["ray_init"] is not None and phases["ray_start"] <= phases["ray_init"] + 0.5, phases
    # the driver's share of the rows phase: idle between answers, busy with them, writing parts
    driver = stats["driver_s"]
    assert set(driver) == {"waiting", "answers", "parts"} and all(v >= 0 for v in driver.values()), driver
    assert driver["answers"] > 0 and driver["parts"] > 0 and driver["answers"] + driver["waiting"] < phases["rows"] + 1, \
        (driver, phases)


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


def test_embed_example(ray_cluster, minilm, sample_csv, tmp_path):
    """examples/embed.yaml: MiniLM at max_model_len 256, the engine test_terminal.py and
    test_openai_batch_files.py run too (the same worker: tests/suite_schedule.py)."""
    import numpy as np

    out = tmp_path / "emb.parquet"
    run_cli("run", str(EXAMPLES / "embed.yaml"), "--quiet", "--set", f"input.path={sample_csv}",
            "--set", "input.limit=12", "--set", f"output.path={out}")
    table = pq.read_table(out)
    assert table.column_names == ["Index", "Company", "embeddings"] and table.num_rows == 12
    assert table.schema.field("embeddings").type.list_size == 384
    vectors = np.array(table.column("embeddings").to_pylist())
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)  # pooling_params.normalize


def run_script(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def test_the_seeds_vision_flows(ray_cluster, test_models):
    """The COCO-style question flow (has_image=True, PIL images) and the captioning flow over
    binary images without its corrupt-image filter (the corrupt ones become error rows)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from captioning import is_valid_image
    finally:
        sys.path.remove(str(EXAMPLES))
    from llmbatch.sample_images import sample_images

    items = sample_images(16, seed=9, corrupt=2)
    dropped = [it for it in items if not is_valid_image({"image_bytes": it["image"]})]
    # the seed's filter (Image.verify) drops the bytes that are no image; a truncated JPEG passes
    # it, and fails in the preprocess (an error row) with the filter on as well as off
    assert len(dropped) == 1 and dropped[0]["corrupt"]
    assert "6 answers" in run_script("vision_qa.py", "6")
    out = run_script("captioning.py", "16", "--no-filter")
    assert "14 captions, 2 errors" in out
    assert out.count("error: preprocess: ") == 2  # undecodable, truncated
