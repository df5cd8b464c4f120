"""Embeddings throughput: llmbatch against plain ``vllm.LLM.embed``, same model and settings.

    python bench/embed_bench.py                      # 5,000 texts, 3 interleaved repeats
    python bench/embed_bench.py --rows 5000 --repeats 5 --systems vllm,llmbatch,llmbatch-job
    python bench/embed_bench.py --device gpu --model DIR --rows 200000 --repeats 3 --warmup  # bench/embed_gpu.sh

Every run is a fresh process that reads the same seeded texts (written once by the parent, one
per line, so generating them is in no system's window), embeds them and writes ``id, embeddings``
(a fixed-size list of float32) to a Parquet file. The systems run interleaved (vllm, llmbatch, vllm,
llmbatch, ...), so a slow minute on a shared machine hits both. Two windows per run:

- **wall**: from the moment the parent starts the process to the moment the child has closed
  its Parquet file (what a user waits for; Python, Ray and engine start-up included);
- **steady**: from the moment the engine was ready (plain vLLM: ``LLM(...)`` returned;
  llmbatch: the replica's ``ready_at``) to the file closed (not shown for ``llmbatch-job``).

Systems: ``vllm`` = ``LLM(model, runner="pooling", convert="embed").embed(texts)`` in one
process; ``llmbatch`` = the processor API (``task_type="embed"``) on a Ray Dataset, written
with ``write_parquet``; ``llmbatch-job`` = ``llmbatch run --task embed`` (job directory,
commits and the output file included). The answers are compared too: the smallest cosine
between a system's embedding of a text and plain vLLM's (read back through Arrow and numpy).

Both systems get exactly the same ``engine_kwargs`` (recorded in the JSON). On ``--device gpu``
nothing CPU-specific is set: ``max_model_len`` (256 by default: MiniLM's sentence-transformers
``max_seq_length``, which vLLM derives as the model's limit and refuses to exceed),
``gpu_memory_utilization`` (0.85 by default), ``enforce_eager=False`` (CUDA graphs and
torch.compile as vLLM's default) and ``dtype`` only if ``--dtype`` is given (vLLM's ``auto``
picks float16 for a pooling model on a GPU). ``--warmup`` runs each system once, untimed, on
``--warmup-rows`` texts before the timed rounds, so vLLM's compile cache and the first CUDA
start are not charged to whichever system goes first; those runs are recorded in the JSON
(``warmup_runs``) and left out of the table and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORDS = ("data engine batch model token river city market cloud shipping retail bank clinic school farm "
         "energy software hardware logistics travel insurance media games robot sensor invoice order customer "
         "review support delivery payment account quarterly growth risk audit contract supplier fleet").split()


def texts(n: int, seed: int = 0) -> list[str]:
    """Seeded sentences of 5 to 60 words (MiniLM's inputs in practice: titles to paragraphs)."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) + "." for i in range(n)]


def engine_kwargs(args) -> dict:
    """The engine settings, computed once in the parent and handed to every system's child."""
    kw = {"max_model_len": args.max_model_len}
    if args.device == "cpu":
        # vLLM's CPU defaults would reserve 92% of the machine's memory; pinned small for both
        kw.update(enforce_eager=True, gpu_memory_utilization=args.gpu_memory_utilization or 0.3,
                  kv_cache_memory_bytes=1 << 30)
        from llmbatch.engines.vllm_setup import native_bf16

        if not native_bf16():  # the float32 llmbatch picks on such a CPU, pinned for every system
            kw["dtype"] = "float32"
    else:  # nothing CPU-specific: vLLM's GPU defaults (CUDA graphs, compile) with the memory share pinned
        kw.update(gpu_memory_utilization=args.gpu_memory_utilization or 0.85, enforce_eager=False)
    if args.dtype:
        kw["dtype"] = args.dtype
    return kw


def read_texts(path: str) -> list[str]:
    return Path(path).read_text(encoding="utf-8").split("\n")


# -- the systems (run in the child process) -------------------------------------------------------


def write(path: Path, vectors) -> None:
    """``id, embeddings`` from a 2-D float32 numpy array: Arrow's fixed-size list over the flat buffer."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    vec = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])
    pq.write_table(pa.table({"id": pa.array(np.arange(len(vectors), dtype=np.int64)), "embeddings": vec}), path)


def run_vllm(data: list[str], model: str, kwargs: dict, args, out: Path) -> dict:
    import numpy as np
    from vllm import LLM

    llm = LLM(model, runner="pooling", convert="embed", **kwargs)
    ready = time.time()
    outs = llm.embed(data, use_tqdm=False)
    write(out, np.asarray([o.outputs.embedding for o in outs], dtype=np.float32))
    done = time.time()
    llm.llm_engine.engine_core.shutdown()
    return {"ready_at": ready, "done_at": done, "rows": len(outs)}


def run_llmbatch(data: list[str], model: str, kwargs: dict, args, out: Path) -> dict:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import ray

    from llmbatch import vLLMEngineProcessorConfig
    from llmbatch.rows import STATS

    ray.init(include_dashboard=False, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = vLLMEngineProcessorConfig(model_source=model, task_type="embed", engine_kwargs=dict(kwargs),
                                       batch_size=args.batch_size)
    from llmbatch.builders import build_layout
    from llmbatch.processor import Processor
    from llmbatch.stages.output import OutputStage

    processor = Processor(config, build_layout(config, preprocess=lambda r: {"prompt": r["text"]},
                                               output=OutputStage(keep_private=(STATS,))))
    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(data)])
    folder = out.with_suffix(".d")
    processor(ds).write_parquet(str(folder))
    done = time.time()
    table = pq.read_table(folder, columns=["id", STATS])
    ready = pc.min(pc.struct_field(table.column(STATS), "ready_at")).as_py()
    ray.shutdown()
    return {"ready_at": ready, "done_at": done, "rows": table.num_rows, "folder": str(folder)}


def run_llmbatch_job(data: list[str], model: str, kwargs: dict, args, out: Path) -> dict:
    inp = Path(args.data).with_suffix(".jsonl")  # written by the parent, like the texts
    stats_dir = out.with_name("job")
    cmd = [sys.executable, "-m", "llmbatch", "run", "--task", "embed", "--input", str(inp), "--text-column", "text",
           "--model", model, "--output", str(out), "--job-dir", str(stats_dir), "--quiet",
           "--set", f"model.batch_size={args.batch_size}"]
    for key, value in kwargs.items():
        cmd += ["--set", f"model.engine_kwargs.{key}={json.dumps(value)}"]
    subprocess.run(cmd, check=True)
    done = time.time()
    stats = json.loads((stats_dir / "stats.json").read_text())
    # no steady window: the job records its engine's ready time only as a duration to its end
    return {"ready_at": None, "done_at": done, "rows": stats["rows_ok"]}


SYSTEMS = {"vllm": run_vllm, "llmbatch": run_llmbatch, "llmbatch-job": run_llmbatch_job}


def child(args) -> None:
    from llmbatch.models import resolve_model

    data = read_texts(args.data)
    out = Path(args.out)
    model = resolve_model(args.model)
    result = SYSTEMS[args.system](data, model, json.loads(args.engine_kwargs), args, out)
    result["model_path"] = model  # after the file closed: outside the timed window
    try:
        import torch
        import vllm

        result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
        if torch.cuda.is_available():
            result["gpu"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # a record only
        result["versions"] = {"error": repr(exc)}
    out.with_suffix(".json").write_text(json.dumps(result))
    os._exit(0)


def write_data(folder: Path, n: int, jsonl: bool) -> Path:
    """The seeded texts, one per line (and as JSONL for the job), written once by the parent."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"texts-{n}.txt"
    data = texts(n)
    assert not any("\n" in t for t in data)
    path.write_text("\n".join(data), encoding="utf-8")
    if jsonl:
        with open(path.with_suffix(".jsonl"), "w") as fh:
            fh.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(data))
    return path


# -- the parent: interleaved repeats ------------------------------------------------------------


def run_one(system: str, args, folder: Path, data: Path, kwargs: dict) -> dict:
    out = folder / f"{system}.parquet"
    cmd = [sys.executable, __file__, "--child", "--system", system, "--data", str(data), "--model", args.model,
           "--device", args.device, "--engine-kwargs", json.dumps(kwargs), "--batch-size", str(args.batch_size),
           "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    started = time.time()
    spy = os.environ.get("LLMBATCH_BENCH_PYSPY") if system in args.profile.split(",") else None
    with open(folder / f"{system}.log", "w") as fh:
        child = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        spies = _sample(spy, child, folder, system) if spy else []
        proc = subprocess.CompletedProcess(cmd, child.wait(timeout=args.timeout))
        for prof in spies:
            prof.wait(timeout=120)
    if proc.returncode != 0 or not out.with_suffix(".json").exists():
        return {"system": system, "error": f"exit {proc.returncode}, log {folder / (system + '.log')}"}
    r = json.loads(out.with_suffix(".json").read_text())
    r.update(system=system, started_at=started, wall_s=r["done_at"] - started,
             steady_s=(r["done_at"] - r["ready_at"]) if r.get("ready_at") else None)
    return r


def _descendants(root: int) -> dict[int, str]:
    """Every process under ``root`` (from /proc), with its command line."""
    parents, cmdlines = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdlines[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        for kid, parent in parents.items():
            if parent == pid and kid not in found:
                found[kid] = cmdlines.get(kid, "")
                todo.append(kid)
    return found


def _sample(spy: str, child: subprocess.Popen, folder: Path, system: str) -> list[subprocess.Popen]:
    """With LLMBATCH_BENCH_PYSPY (a py-spy binary) and --profile naming this system: the run's
    process, and each Python process that appears under it (Ray's workers, vLLM's engine), sampled
    20 times a second without pausing them, raw stacks per process beside the log
    (``SYSTEM-pyspy-PID.txt``, with ``SYSTEM-pyspy-procs.json`` naming each PID's command line)."""
    import threading

    spies: list[subprocess.Popen] = []
    seen: dict[int, str] = {}

    def record(pid: int) -> None:
        spies.append(subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "20", "--nonblocking",
                                       "--format", "raw", "--output", str(folder / f"{system}-pyspy-{pid}.txt")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def watch() -> None:
        record(child.pid)
        seen[child.pid] = "the run's process"
        while child.poll() is None:
            for pid, cmd in _descendants(child.pid).items():
                if pid not in seen and ("python" in cmd or cmd.startswith(("ray::", "VLLM"))):
                    seen[pid] = cmd
                    record(pid)
                    (folder / f"{system}-pyspy-procs.json").write_text(json.dumps(seen, indent=1))
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()
    return spies


def vectors(result: dict, folder: Path):
    """A system's ``embeddings`` column as an (rows, dim) float32 array in id order, through Arrow:
    a fixed-size list, a list or Ray's tensor extension (whose storage is a list) all flatten."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = result.get("folder") or str(folder / f"{result['system']}.parquet")
    table = pq.read_table(path, columns=["id", "embeddings"]).sort_by("id")
    col = table.column("embeddings").combine_chunks()
    if isinstance(col.type, pa.ExtensionType):
        col = col.storage
    flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return flat.reshape(table.num_rows, -1)


def min_cosine(a, b) -> float:
    import numpy as np

    a = a.astype(np.float64)
    b = b.astype(np.float64)
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    return float(np.einsum("ij,ij->i", a, b).min())


def summary(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="vllm,llmbatch")
    p.add_argument("--rows", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="all-minilm-l6-v2", help="an llmbatch model alias or a model folder")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--max-model-len", type=int, default=256,
                   help="MiniLM's sentence-transformers max_seq_length; vLLM refuses more without an override")
    p.add_argument("--dtype", default=None, help="engine dtype for both systems (default: vLLM's auto; "
                   "float32 pinned on a CPU without native bfloat16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="for both systems (default 0.85 on --device gpu, 0.3 on cpu)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--warmup", action="store_true",
                   help="one untimed run of each system on --warmup-rows texts before the timed rounds")
    p.add_argument("--warmup-rows", type=int, default=2000)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--profile", default="", help="systems to sample with py-spy (LLMBATCH_BENCH_PYSPY: the binary)")
    p.add_argument("--json", default=str(HERE / "embed-results" / "embed.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--engine-kwargs", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {sorted(SYSTEMS)}")
    kwargs = engine_kwargs(args)  # one dict, handed unchanged to every system
    data_dir = Path(tempfile.mkdtemp(prefix="llmbatch-embed-data-"))
    job = "llmbatch-job" in systems
    data = write_data(data_dir, args.rows, job)
    runs: list[dict] = []
    warmups: list[dict] = []
    agree: dict[str, float] = {}
    if args.warmup:
        small = write_data(data_dir, args.warmup_rows, job)
        for system in systems:
            folder = Path(tempfile.mkdtemp(prefix=f"llmbatch-embed-warmup-{system}-"))
            r = run_one(system, args, folder, small, kwargs)
            r.update(warmup=True, rows_requested=args.warmup_rows)
            warmups.append(r)
            print(json.dumps(r), flush=True)
    for rep in range(args.repeats):
        for system in systems if rep % 2 == 0 else systems[::-1]:  # interleaved, alternating order
            folder = Path(tempfile.mkdtemp(prefix=f"llmbatch-embed-{system}-"))
            r = run_one(system, args, folder, data, kwargs)
            r["repeat"] = rep
            runs.append(r)
            if "error" not in r:
                r["rows_s_wall"] = r["rows"] / r["wall_s"]
                r["rows_s_steady"] = r["rows"] / r["steady_s"] if r.get("steady_s") else None
                if rep == 0:
                    r["_vectors"] = vectors(r, folder)
            print(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}), flush=True)
    first = {r["system"]: r.get("_vectors") for r in runs if r["repeat"] == 0}
    if first.get("vllm") is not None:
        for system, vec in first.items():
            if system != "vllm" and vec is not None:
                if vec.shape != first["vllm"].shape:  # a missing row or another dimension: no comparison
                    agree[system] = f"shape {vec.shape} vs vllm {first['vllm'].shape}"
                else:
                    agree[system] = min_cosine(vec, first["vllm"])
    table = {s: {"wall_s": summary([r for r in runs if r["system"] == s], "wall_s"),
                 "steady_s": summary([r for r in runs if r["system"] == s], "steady_s"),
                 "rows_s_wall": summary([r for r in runs if r["system"] == s], "rows_s_wall"),
                 "rows_s_steady": summary([r for r in runs if r["system"] == s], "rows_s_steady")} for s in systems}
    ratios = {}
    if "vllm" in systems:
        for s in systems:
            if s != "vllm" and table[s]["rows_s_wall"] and table["vllm"]["rows_s_wall"]:
                ratios[s] = {"wall": table[s]["rows_s_wall"]["median"] / table["vllm"]["rows_s_wall"]["median"],
                             "steady": (table[s]["rows_s_steady"]["median"] / table["vllm"]["rows_s_steady"]["median"]
                                        if table[s]["rows_s_steady"] else None)}
                walls = {(r["repeat"], r["system"]): r.get("wall_s") for r in runs}
                ratios[s]["wall_per_round"] = [walls[(k, "vllm")] / walls[(k, s)] if walls.get((k, "vllm"))
                                               and walls.get((k, s)) else None for k in range(args.repeats)]
    report = {"rows": args.rows, "model": args.model, "device": args.device, "engine_kwargs": kwargs,
              "batch_size": args.batch_size, "repeats": args.repeats, "order": "interleaved, alternating per round",
              "warmup": {"done": bool(warmups), "rows": args.warmup_rows if warmups else 0,
                         "note": "untimed for the criterion: not in runs, summary or ratios"},
              "warmup_runs": warmups,
              "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
              "summary": table, "ratios_vs_vllm": ratios, "min_cosine_vs_vllm": agree,
              "command": [sys.executable, *sys.argv]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print("\n| system | wall s (median, min-max) | rows/s wall | steady s (median, min-max) | rows/s steady |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for s in systems:
        w, st = table[s]["wall_s"], table[s]["steady_s"]
        if not w:
            print(f"| {s} | failed | | | |")
            continue
        print(f"| {s} | {w['median']:.1f} ({w['min']:.1f}-{w['max']:.1f}) | {table[s]['rows_s_wall']['median']:.0f} | "
              + (f"{st['median']:.1f} ({st['min']:.1f}-{st['max']:.1f}) | {table[s]['rows_s_steady']['median']:.0f} |"
                 if st else "| |"))
    print("ratios vs vllm (median rows/s):", json.dumps(ratios), " min cosine vs vllm:", json.dumps(agree))


if __name__ == "__main__":
    main()
