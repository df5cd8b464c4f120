"""CPU per row in a replica, outside the engine: the real stages of a job's replica (the job's
prompt template, chat template, tokenizer, the engine stage with its dedup, detokenize) and the
row codec, over rows that share a dozen companies (``--distinct``), with an engine that answers at once.

    python bench/row_cpu.py [--rows 10000] [--distinct 12] [--demo-prompt] [--repeat 3] [--system LABEL=SRC ...] [--out FILE]

Each measurement is a fresh process (``--system`` runs another source tree, e.g. a git worktree
of an older commit, with the same Python and packages; systems alternate within each repeat).
The figure is the process's CPU time (every thread: the tokenizer's too) per row after a
warm-up batch, so other work on a shared machine moves it less than wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path



def measure(rows: int, distinct: int, demo_prompt: bool) -> dict:
    import tempfile

    from llmbatch.codec import decode_rows, encode_rows
    from llmbatch.jobs.driver import build_job_processor
    from llmbatch.jobs.spec import load_job
    from llmbatch.rows import ROW_ID
    from llmbatch.stages.runner import run_stages

    from llmbatch.demo import SYSTEM_PROMPT, USER_PROMPT

    folder = Path(tempfile.mkdtemp(prefix="row-cpu-"))
    prompt = ({"system": SYSTEM_PROMPT, "user": USER_PROMPT} if demo_prompt
              else {"user": "Which industry is {Company} in? One word."})
    (folder / "in.csv").write_text("Index,Company\n0,Company A\n")
    spec = load_job(data={"input": {"path": str(folder / "in.csv"), "id_column": "Index"},
                          "model": {"source": "smollm2-135m-instruct", "engine_kwargs": {"max_model_len": 512},
                                    "keep_warm_s": 0},
                          "prompt": prompt,
                          "sampling_params": {"temperature": 0, "max_tokens": 4},
                          "output": {"path": str(folder / "out.parquet")}})
    layout = build_job_processor(spec).layout
    stages = [s.stage for s in layout.pre] + [layout.engine] + [s.stage for s in layout.post]
    engine = layout.engine.engine

    async def start() -> None:
        engine.capacity = 256

    async def run(request) -> dict:
        return {"prompt": "", "num_input_tokens": 40, "time_taken_llm": 0.01, "request_id": 1,
                "num_cached_tokens": None, "generated_text": "", "generated_tokens": [504, 4354, 338, 2],
                "num_generated_tokens": 4, "finish_reason": "stop"}

    engine.start, engine.run, engine.on_cpu = start, run, True

    async def go() -> tuple[float, float]:
        for stage in stages:
            stage.begin()
            await stage.start()
        companies = [f"Company {i} of {distinct}" for i in range(distinct)]
        batch = encode_rows([{"Index": str(i), "Company": companies[i % distinct], ROW_ID: i} for i in range(rows + 256)])
        async for chunk in run_stages(stages, decode_rows(batch.slice(0, 256))):  # warm-up
            encode_rows(chunk)
        wall, cpu = time.perf_counter(), time.process_time()
        for start_at in range(256, rows + 256, 256):
            async for chunk in run_stages(stages, decode_rows(batch.slice(start_at, 256))):
                encode_rows(chunk)
        return time.perf_counter() - wall, time.process_time() - cpu

    wall, cpu = asyncio.run(go())
    return {"rows": rows, "distinct": distinct, "demo_prompt": demo_prompt, "cpu_us_per_row": round(cpu / rows * 1e6, 1), "wall_us_per_row": round(wall / rows * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--distinct", type=int, default=12, help="distinct companies among the rows")
    ap.add_argument("--demo-prompt", action="store_true",
                    help="the demo's prompt (a 250-token few-shot system prompt, the company as the user turn)")
    ap.add_argument("--system", action="append", default=[])
    ap.add_argument("--out", default="")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.rows, args.distinct, args.demo_prompt)))
        return
    systems = [s.split("=", 1) for s in args.system] or [["current", str(Path(__file__).resolve().parent.parent / "src")]]
    runs = []
    for r in range(args.repeat):
        for label, src in (systems if r % 2 == 0 else systems[::-1]):
            env = {**os.environ, "PYTHONPATH": src}
            out = subprocess.run([sys.executable, __file__, "--one", "--rows", str(args.rows),
                                  "--distinct", str(args.distinct), *(["--demo-prompt"] if args.demo_prompt else [])], env=env,
                                 capture_output=True, text=True, timeout=1200)
            result = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"failed": out.stderr[-2000:]}
            runs.append({"system": label, "repeat": r, **result})
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for label, _ in systems:
        cpu = [x["cpu_us_per_row"] for x in runs if x["system"] == label and "cpu_us_per_row" in x]
        if cpu:
            summary[label] = {"cpu_us_per_row": [statistics.median(cpu), min(cpu), max(cpu)]}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary, "systems": systems}, indent=1))


if __name__ == "__main__":
    main()
