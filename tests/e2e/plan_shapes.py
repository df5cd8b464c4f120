"""The dataset plans users write in front of a processor, run on the real engine.

Run as a script (``python tests/e2e/plan_shapes.py --cpus 1 --out result.json``): it starts
its own Ray with that many CPUs (with ``--join``, it joins ``RAY_ADDRESS`` instead where that
cluster has exactly that many CPUs: the test worker's own), runs every shape in :data:`SHAPES`
through one ``vLLMEngineProcessorConfig`` processor and records, per shape, the ids that came
out, the seconds it took and any error. The shapes share one warm engine
(``LLMBATCH_KEEP_WARM_S`` in the suite): each replica of each shape is a Ray Data actor of its
plan as always, and leases the engine host. ``test_plan_shapes.py`` runs it under 1 and 2 CPUs and checks
that every row came out exactly once and nothing hung.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROWS = 24          # rows per input (a few per batch, several batches)
ENGINE = dict(max_model_len=512)  # the suite's usual settings: a warm engine of them may be there
RUN_BOUND_S = 600  # stall timeout of the shapes that must run


def preprocess(row):
    return dict(prompt=f"Item {row['id']} is a", sampling_params=dict(temperature=0, max_tokens=2))


def postprocess(row):
    return dict(id=int(row["id"]), answer=row["generated_text"])


def make_inputs(root: Path) -> dict[str, str]:
    import pandas as pd

    root.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame({"id": range(ROWS), "name": [f"name {i}" for i in range(ROWS)],
                       "keep": [i % 3 != 0 for i in range(ROWS)]})
    df.to_csv(root / "rows.csv", index=False)
    df.to_json(root / "rows.jsonl", orient="records", lines=True)
    (root / "parquet").mkdir(exist_ok=True)
    for k in range(4):
        df.iloc[k * ROWS // 4:(k + 1) * ROWS // 4].to_parquet(root / "parquet" / f"part-{k}.parquet")
    df.to_parquet(root / "one.parquet")
    return {"csv": str(root / "rows.csv"), "jsonl": str(root / "rows.jsonl"), "parquet": str(root / "parquet"),
            "one": str(root / "one.parquet"), "root": str(root)}


# Each shape: name -> function(ray.data, paths, processor, out_dir) -> list of output ids,
# and the ids it must produce.

def _ids(rows) -> list[int]:
    return [int(r["id"]) for r in rows]


def _read_written(path: str) -> list[int]:
    import pyarrow.parquet as pq

    return [int(i) for i in pq.read_table(path, columns=["id"]).column("id").to_pylist()]


def shape_blocks_filter_map_write(rd, p, proc, out):
    ds = rd.read_csv(p["csv"], override_num_blocks=8).filter(lambda r: r["keep"]).map(lambda r: {**r, "name": r["name"].upper()})
    proc(ds).write_parquet(out)
    return _read_written(out), [i for i in range(ROWS) if i % 3 != 0]


def shape_json_repartition_take_all(rd, p, proc, out):
    ds = rd.read_json(p["jsonl"]).repartition(4)
    return _ids(proc(ds).take_all()), list(range(ROWS))


def shape_parquet_map_batches_iter(rd, p, proc, out):
    ds = rd.read_parquet(p["parquet"]).map_batches(lambda b: b, batch_format="pandas")
    ids = []
    for batch in proc(ds).iter_batches(batch_size=5, batch_format="pandas"):
        ids.extend(int(i) for i in batch["id"])
    return ids, list(range(ROWS))


def shape_items_shuffle_take_all(rd, p, proc, out):
    ds = rd.from_items([{"id": i, "name": f"n{i}"} for i in range(ROWS)]).random_shuffle()
    return _ids(proc(ds).take_all()), list(range(ROWS))


def shape_pandas_union_show(rd, p, proc, out):
    import pandas as pd

    # 10 rows: a batch of 4 holds pandas and Arrow rows (Ray Data alone cannot batch those)
    a = rd.from_pandas(pd.DataFrame({"id": range(0, 10), "name": ["a"] * 10}))
    b = rd.from_items([{"id": i, "name": "b"} for i in range(10, ROWS)])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        proc(a.union(b)).show(limit=ROWS)
    ids = [json.loads(line.replace("'", '"'))["id"] for line in buf.getvalue().splitlines() if line.startswith("{")]
    return ids, list(range(ROWS))


def shape_limit_iter_rows(rd, p, proc, out):
    ds = rd.read_csv(p["csv"]).limit(10)
    return [int(r["id"]) for r in proc(ds).iter_rows()], list(range(10))


def shape_one_block_materialize(rd, p, proc, out):
    ds = rd.read_parquet(p["one"], override_num_blocks=1)
    return _ids(proc(ds).materialize().take_all()), list(range(ROWS))


def shape_small_blocks_filter(rd, p, proc, out):
    ds = rd.from_items([{"id": i} for i in range(ROWS)]).repartition(target_num_rows_per_block=5)
    ds = ds.filter(lambda r: r["id"] % 2 == 0)
    return _ids(proc(ds).materialize().take_all()), list(range(0, ROWS, 2))


def shape_json_limit_repartition_map_write(rd, p, proc, out):
    ds = rd.read_json(p["jsonl"], override_num_blocks=3).limit(20).repartition(num_blocks=3).map(lambda r: r)
    proc(ds).write_parquet(out)
    return _read_written(out), list(range(20))


def shape_checkpoint_rerun(rd, p, proc, out):
    """Ray Data checkpoints (read -> processor -> write): a first run over half the files,
    then a rerun over all of them that must skip the checkpointed ids."""
    import ray
    from ray.data.checkpoint import CheckpointConfig

    ctx = ray.data.DataContext.get_current()
    old = ctx.checkpoint_config
    files = sorted(str(f) for f in Path(p["parquet"]).glob("*.parquet"))
    ctx.checkpoint_config = CheckpointConfig(id_column="id", checkpoint_path=out + ".ckpt",
                                             delete_checkpoint_on_success=False)
    try:
        proc(rd.read_parquet(files[:2])).write_parquet(out + ".1")
        proc(rd.read_parquet(files)).write_parquet(out + ".2")
    finally:
        ctx.checkpoint_config = old
    return _read_written(out + ".1") + _read_written(out + ".2"), list(range(ROWS))


SHAPES = {name.removeprefix("shape_"): fn for name, fn in sorted(globals().items()) if name.startswith("shape_")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpus", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--stall-timeout", type=float, default=60.0, help="for the shapes named by --expect-stall")
    parser.add_argument("--expect-stall", nargs="*", default=[], help="shapes that cannot run on this many CPUs")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--join", action="store_true",
                        help="join RAY_ADDRESS where that cluster has exactly --cpus CPUs")
    args = parser.parse_args()

    import ray
    import ray.data as rd

    from llmbatch import build_processor, vLLMEngineProcessorConfig

    from llmbatch import startlog

    address = os.environ.pop("RAY_ADDRESS", None)
    if args.join and address:
        ray.init(address=address, logging_level="ERROR", log_to_driver=bool(os.environ.get("SHAPES_VERBOSE")))
        if ray.cluster_resources().get("CPU") != args.cpus:
            ray.shutdown()  # another size: a Ray of its own after all
            address = None
    if not (args.join and address):
        with startlog.timed("ray-cluster", cpus=args.cpus):
            ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR",
                     log_to_driver=bool(os.environ.get("SHAPES_VERBOSE")))
    rd.DataContext.get_current().enable_progress_bars = False
    def processor(stall_timeout_s: float):
        config = vLLMEngineProcessorConfig(model_source="smollm2-135m-instruct", engine_kwargs=ENGINE, batch_size=4,
                                           concurrency=1, stall_timeout_s=stall_timeout_s)
        return build_processor(config, preprocess=preprocess, postprocess=postprocess)

    # a shape that must stall fails after --stall-timeout; the others get a bound that only a
    # real hang reaches, however slowly a loaded machine starts a replica's worker process
    runs, stalls = processor(RUN_BOUND_S), processor(args.stall_timeout)
    paths = make_inputs(Path(args.work) / "inputs")
    results = {}
    for name, fn in SHAPES.items():
        if args.only and name not in args.only:
            continue
        start = time.time()
        try:
            proc = stalls if name in args.expect_stall else runs
            got, want = fn(rd, paths, proc, str(Path(args.work) / f"out-{name}"))
            results[name] = {"got": sorted(got), "want": sorted(want), "seconds": round(time.time() - start, 1)}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:],
                             "seconds": round(time.time() - start, 1)}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "trace"})[:300], flush=True)
        Path(args.out).write_text(json.dumps(results))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
