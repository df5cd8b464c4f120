"""Every dataset plan users write in front of a processor runs, on 2 CPUs and on 1 CPU.

``plan_shapes.py`` runs each shape (read_csv/read_json/read_parquet/from_items/from_pandas
with and without override_num_blocks, then limit, repartition, filter, map, map_batches,
random_shuffle, union, then the processor, then materialize, take_all, iter_batches,
iter_rows, write_parquet, show, and Ray Data checkpoints) on the real engine, in a Ray with
that many CPUs (the 1-CPU run's own; the 2-CPU run joins the test worker's Ray, which has 2).
The two runs go one after the other (side by side, with the other test worker's file, they
made a third Ray cluster and engines beyond what two cores carry); each shape must give every row once. The shapes of a run share
one warm engine (each shape's replica is an actor of its plan and leases the engine host), so
a shape costs seconds, not an engine start; each runs once: on 2 CPUs the shapes whose work Ray spreads over both (several read blocks with parallel
writes, a shuffle, a union, the checkpoint filter's actor beside the engine), on 1 CPU, where
the stages and the engine compete hardest for the core, all the others (several files, one
block of everything, small blocks, a limit, a repartition after a limit, iter_rows and
iter_batches) and the checkpoint shape again, which cannot run there.

One shape cannot run on 1 CPU whatever the processor does: Ray Data's checkpoint filter is an
actor that holds a whole CPU, so its read task can never start (plain Ray Data, without
llmbatch, hangs the same way). There the run must fail with a StallError that says so, in
time, instead of hanging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
STALL_S = 90  # the stall timeout of the shape that cannot run (the others get 600 s: plan_shapes.py)
CANNOT_RUN = {1: {"checkpoint_rerun"}}
ON_TWO_CPUS = ("blocks_filter_map_write", "items_shuffle_take_all", "pandas_union_show", "checkpoint_rerun")


def _shapes() -> dict:
    """plan_shapes.SHAPES (the runner script beside this file)."""
    sys.path.insert(0, str(HERE))
    try:
        import plan_shapes
    finally:
        sys.path.remove(str(HERE))
    return plan_shapes.SHAPES


def shapes_on(cpus: int) -> list[str]:
    """The shapes each run takes: the spreading ones on 2 CPUs, the rest and the checkpoint on 1."""
    if cpus == 2:
        return list(ON_TWO_CPUS)
    return [name for name in _shapes() if name not in ON_TWO_CPUS or name in CANNOT_RUN[1]]


@pytest.fixture(scope="module")
def results(ray_cluster, smollm2, tmp_path_factory):
    found = {}
    for cpus in (2, 1):  # one after the other: each run starts an engine, the 1-CPU run a Ray too
        work = tmp_path_factory.mktemp(f"shapes{cpus}")
        out = work / "result.json"
        # the 2-CPU run joins the test worker's own Ray where it has 2 CPUs (one Ray less to start,
        # and the worker's warm engine if it has one); the 1-CPU run starts a Ray of 1 CPU. Both
        # engines compute on the worker's cores (tests/conftest.py's VLLM_CPU_OMP_THREADS_BIND)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" or cpus == 2}
        cmd = [sys.executable, str(HERE / "plan_shapes.py"), "--cpus", str(cpus), "--out", str(out),
               "--work", str(work), "--stall-timeout", str(STALL_S), "--join", "--only", *shapes_on(cpus)]
        if CANNOT_RUN.get(cpus):
            cmd += ["--expect-stall", *CANNOT_RUN[cpus]]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=1800)
        assert proc.returncode == 0, proc.stdout[-4000:]
        found[cpus] = json.loads(out.read_text())
    return found


def test_there_are_at_least_ten_shapes():
    shapes = _shapes()
    assert len(shapes) >= 10
    assert set(ON_TWO_CPUS) <= set(shapes)


@pytest.mark.parametrize("cpus", [2, 1])
def test_every_shape_answers_every_row_once(results, cpus):
    shapes = results[cpus]
    assert sorted(shapes) == sorted(shapes_on(cpus))
    for name, r in shapes.items():
        if name in CANNOT_RUN.get(cpus, ()):
            continue
        assert "error" not in r, f"{name} on {cpus} CPU: {r.get('error')}\n{r.get('trace', '')}"
        assert r["got"] == r["want"], f"{name} on {cpus} CPU: rows lost or repeated"


def test_a_plan_ray_data_cannot_run_fails_with_the_reason_instead_of_hanging(results):
    r = results[1]["checkpoint_rerun"]
    assert "StallError" in r.get("error", ""), r
    assert "CheckpointFilter" in r["error"] and "1 CPU" in r["error"]
    assert r["seconds"] < 600
