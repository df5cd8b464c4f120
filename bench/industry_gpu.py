"""The seeds' industry job on a GPU: llmbatch (``llmbatch run``, a real job process) against plain
vLLM (``LLM.chat`` over every row with the same choice constraint, answers written to Parquet),
each in a fresh process with the same model folder and the same pinned engine settings.

    python bench/industry_gpu.py --system llmbatch|vllm --model DIR --input customers.csv --out DIR
        [--rows N] [--set FIELD=VALUE ...]

The job is bench/row_marginal.py's (its system prompt, "What industry is this company in:
{Company}", nine industries, temperature 0, max_tokens 16). Per run, in ``OUT/<system>-<rows>.json``:
the wall from the process's launch to its answers written and the process's end, the job's
phases (llmbatch's ``stats.json``), GPU utilisation every 0.5 s (``nvidia-smi``), and for
llmbatch the engine's requests in flight over time (from the committed rows' stats) and its
requests sent. ``--compare A.parquet`` adds the share of rows whose answer equals another run's.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from row_marginal import CHOICES, SYSTEM, USER, in_flight_timeline

PINNED = {"max_model_len": 2048, "max_num_seqs": 1024, "max_num_batched_tokens": 16384,
          "gpu_memory_utilization": 0.85, "enable_prefix_caching": True, "load_format": "dummy"}


class GpuSampler:
    """``nvidia-smi`` every ``step`` seconds on a thread: [seconds since start, mean util % of the
    GPUs this run may use (``CUDA_VISIBLE_DEVICES``, else all), their MiB together, each one's util %]."""

    def __init__(self, step: float = 0.5):
        self.step, self.points, self._stop = step, [], threading.Event()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        self.visible = {int(i) for i in visible.split(",") if i.strip().isdigit()} if visible else None
        self.t0 = time.time()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def sample(self, text: str) -> list | None:
        """One sample from ``nvidia-smi --query-gpu=index,utilization.gpu,memory.used`` output."""
        gpus = [[int(v) for v in line.split(",")] for line in text.strip().splitlines() if line.strip()]
        gpus = [g for g in gpus if self.visible is None or g[0] in self.visible]
        if not gpus:
            return None
        utils = [g[1] for g in gpus]
        return [round(time.time() - self.t0, 1), round(sum(utils) / len(utils)), sum(g[2] for g in gpus), utils]

    def _run(self) -> None:
        while not self._stop.wait(self.step):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
                point = self.sample(out.stdout)
                if point:
                    self.points.append(point)
            except Exception:  # noqa: BLE001 - a missing sample, not a failed run
                pass

    def stop(self) -> list:
        self._stop.set()
        self.thread.join(timeout=10)
        return self.points


def busy_share(points: list, since: float = 0.0) -> float | None:
    """Mean GPU utilisation over the samples after ``since`` seconds."""
    vals = [p[1] for p in points if p[0] >= since]
    return round(sum(vals) / len(vals), 1) if vals else None


def run_llmbatch(args) -> dict:
    folder = Path(args.out) / f"llmbatch-{args.rows}-{int(time.time())}"
    folder.mkdir(parents=True)
    job = {"input": {"path": str(Path(args.input).resolve()), "id_column": "Index", "limit": args.rows},
           "model": {"source": str(Path(args.model).resolve()), "engine_kwargs": PINNED, "batch_size": 256,
                     "keep_warm_s": 0},
           "prompt": {"system": SYSTEM, "user": USER, "choices": CHOICES},
           "sampling_params": {"temperature": 0, "max_tokens": 16},
           "output": {"path": str(folder / "out.parquet"), "columns": ["Index", "generated_text"]}}
    (folder / "job.yaml").write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "llmbatch", "run", str(folder / "job.yaml"), "--quiet"]
    for s in args.sets:
        cmd += ["--set", s]
    # every replica appends a byte per request before it hands it its engine (stages/engine.py):
    # the requests that reached the engines, the killed run's included
    tally = folder / "requests"
    os.environ["LLMBATCH_REQUEST_TALLY_DIR"] = str(tally)
    gpu = GpuSampler()
    t0 = time.time()
    killed = {}
    if args.kill_at:  # SIGKILL the job's process group once this many rows are committed, then resume
        killed = kill_when_committed(cmd, folder / "out.parquet.job", args.kill_at, args.timeout)
        killed["requests_sent_before_kill"] = sent_requests(tally)
        cmd = [sys.executable, "-m", "llmbatch", "resume", str(folder / "out.parquet.job"), "--quiet"]
    proc = run_job(cmd, args.timeout, folder / "driver-pyspy.txt")
    wall = time.time() - t0
    points = gpu.stop()
    result = {"system": "llmbatch", "rows": args.rows, "rc": proc.returncode, "wall_s": round(wall, 2),
              "gpu": points, "sets": args.sets, **killed}
    if proc.returncode != 0:
        result["stderr"] = proc.stderr[-4000:]
        log = folder / "out.parquet.job" / "log.txt"
        result["log"] = log.read_text()[-4000:] if log.exists() else ""
        return result
    job_dir = folder / "out.parquet.job"
    stats = json.loads((job_dir / "stats.json").read_text())
    import pyarrow.parquet as pq

    ids = pq.read_table(folder / "out.parquet", columns=["Index"]).column(0).to_pylist()
    timeline = in_flight_timeline(job_dir)
    rows_start = (stats["phases_s"].get("to_first_row") or 0)
    import pyarrow.csv as pacsv  # the distinct prompts: what the requests sent are held against

    companies = pacsv.read_csv(args.input, convert_options=pacsv.ConvertOptions(include_columns=["Company"]))
    result["distinct_prompts"] = len(set(companies.column(0).slice(0, args.rows).to_pylist()))
    result.update(rows_ok=stats["rows_ok"], rows_error=stats["rows_error"], ids_once=len(ids) == len(set(ids)) == args.rows,
                  requests_to_engine=stats["rows_ok"] - stats["deduplicated_rows"], requests_sent=sent_requests(tally),
                  generated_tokens=stats["generated_tokens"], phases_s=stats["phases_s"], driver_s=stats.get("driver_s"),
                  in_flight=timeline,
                  engines=per_engine(job_dir), cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                  gpu_busy_rows_phase=busy_share(points, rows_start), output=str(folder / "out.parquet"))
    return result


def per_engine(job_dir: Path) -> dict:
    """{replica: {devices, requests, generated_tokens}} from the committed rows the engines
    answered (a group's copies left out): which GPU each replica ran on and what it generated."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out: dict = {}
    for part in sorted(glob.glob(str(job_dir / "parts" / "*.parquet"))):
        names_in = set(pq.read_schema(part).names)
        if "__llmbatch_stats" not in names_in:
            continue
        table = pq.read_table(part, columns=[c for c in ("__llmbatch_stats", "num_generated_tokens") if c in names_in])
        stats = table.column("__llmbatch_stats")
        if stats.null_count == len(stats) or not hasattr(stats.type, "get_field_index"):
            continue
        sent = pc.invert(pc.fill_null(pc.struct_field(stats, "deduped"), True))
        names = pc.struct_field(stats, "replica").filter(sent).to_pylist()
        devices = pc.struct_field(stats, "devices").filter(sent).to_pylist()
        tokens = (pc.fill_null(table.column("num_generated_tokens"), 0).filter(sent).to_pylist()
                  if "num_generated_tokens" in names_in else [0] * len(names))
        for name, dev, n in zip(names, devices, tokens):
            e = out.setdefault(str(name), {"devices": dev, "requests": 0, "generated_tokens": 0})
            e["requests"] += 1
            e["generated_tokens"] += int(n)
    return out


def sent_requests(tally: Path) -> int:
    """The requests the job's replicas handed their engines (one byte each, written before)."""
    return sum(f.stat().st_size for f in tally.glob("*")) if tally.is_dir() else 0


def committed_rows(job_dir: Path) -> int:
    import pyarrow.parquet as pq

    total = 0
    for part in glob.glob(str(job_dir / "parts" / "*.parquet")):
        try:
            total += pq.read_metadata(part).num_rows
        except Exception:  # noqa: BLE001 - a part being renamed into place
            pass
    return total


def kill_when_committed(cmd: list[str], job_dir: Path, rows: int, timeout: float) -> dict:
    """Run ``cmd`` in a session of its own; SIGKILL the whole session once ``rows`` rows are
    committed. Returns when it was killed and how many rows were committed then."""
    t0 = time.time()
    log = job_dir.parent / "killed-run.log"  # its output: a job that fails before the kill says why here
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    committed = 0
    while proc.poll() is None and time.time() - t0 < timeout:
        committed = committed_rows(job_dir)
        if committed >= rows:
            break
        time.sleep(0.5)
    if proc.poll() is not None:  # it ended by itself: nothing to kill, and no kill to measure
        raise SystemExit(f"the job ended (rc {proc.returncode}) after {time.time() - t0:.1f} s with {committed} rows "
                         f"committed, before {rows} were: its output is in {log}:\n{log.read_text()[-3000:]}")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return {"killed_after_s": round(time.time() - t0, 2), "killed_at_rows": committed_rows(job_dir)}


def run_vllm(args) -> dict:
    import psutil

    start = psutil.Process().create_time()
    with open(args.input, newline="") as f:
        rows = [r for _, r in zip(range(args.rows), csv.DictReader(f))]
    gpu = GpuSampler()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(str(Path(args.model).resolve()), **PINNED)
    ready = time.time()
    first: list[float] = []
    add_request = llm.llm_engine.add_request

    def noted(*a, **kw):
        if not first:
            first.append(time.time())
        return add_request(*a, **kw)

    llm.llm_engine.add_request = noted
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER.format(**r)}] for r in rows]
    outs = llm.chat(messages, params, use_tqdm=False)
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(args.out)
    path = folder / f"vllm-{args.rows}-{int(time.time())}.parquet"
    pq.write_table(pa.table({"Index": [r["Index"] for r in rows], "generated_text": [o.outputs[0].text for o in outs]}),
                   path)
    end = time.time()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.llm_engine.engine_core.shutdown()
    points = gpu.stop()
    return {"system": "vllm", "rows": len(rows), "rc": 0, "wall_s": round(end - start, 2),
            "engine_ready_s": round(ready - start, 2), "to_first_request_s": round(first[0] - start, 2) if first else None,
            "engine_window_s": round(end - first[0], 2) if first else None, "requests_to_engine": len(rows),
            "generated_tokens": gen, "gpu": points, "output": str(path),
            "gpu_busy_after_first_request": busy_share(points, (first[0] - gpu.t0) if first else 0.0)}


def agreement(a: str, b: str) -> dict:
    import pyarrow.parquet as pq

    x = {str(k): v for k, v in zip(*[pq.read_table(a).column(c).to_pylist() for c in ("Index", "generated_text")])}
    y = {str(k): v for k, v in zip(*[pq.read_table(b).column(c).to_pylist() for c in ("Index", "generated_text")])}
    both = set(x) & set(y)
    same = sum(1 for k in both if x[k] == y[k])
    return {"rows_compared": len(both), "same": same, "share": round(same / len(both), 4) if both else None}


def run_job(cmd: list[str], timeout: float, profile: Path) -> subprocess.CompletedProcess:
    """The job's process to its end; with ``LLMBATCH_BENCH_PYSPY`` (a py-spy binary) the
    driver's threads are sampled beside it (20 a second, without pausing it: raw stacks in
    ``profile``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spy = os.environ.get("LLMBATCH_BENCH_PYSPY")
    prof = subprocess.Popen([spy, "record", "--pid", str(proc.pid), "--rate", "20", "--nonblocking", "--format", "raw",
                             "--output", str(profile)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if spy else None
    out, err = proc.communicate(timeout=timeout)
    if prof is not None:
        prof.wait(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", required=True, choices=["llmbatch", "vllm"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--rows", type=int, default=200000)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--timeout", type=int, default=560)
    ap.add_argument("--compare", default="")
    ap.add_argument("--kill-at", type=int, default=0, help="SIGKILL the job once this many rows are committed, "
                    "then `llmbatch resume` it (wall: both, from the first launch)")
    ap.add_argument("--engine-kwargs", default="", help="JSON: instead of the pinned GPU settings (a CPU dry run)")
    args = ap.parse_args()
    if args.engine_kwargs:
        PINNED.clear()
        PINNED.update(json.loads(args.engine_kwargs))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = run_llmbatch(args) if args.system == "llmbatch" else run_vllm(args)
    if args.compare and result.get("output"):
        result["agreement"] = agreement(result["output"], args.compare)
    name = Path(args.out) / f"{args.system}-{args.rows}-{int(time.time())}.json"
    name.write_text(json.dumps(result, indent=1))
    brief = {k: v for k, v in result.items() if k not in ("gpu", "in_flight")}
    print(json.dumps(brief), flush=True)


if __name__ == "__main__":
    main()
