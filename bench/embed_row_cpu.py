"""CPU per embedded row in a replica, outside the engine: the real tokenize stage, engine stage
(request building, dedup bookkeeping, the vLLM engine's own output shaping) and output stage of
an ``embed`` processor, over seeded texts, with an engine that answers at once (a 384-float
tensor, as vLLM's pooled output).

    python bench/embed_row_cpu.py [--rows 5120] [--repeat 3] [--job] [--system LABEL=SRC ...] [--out FILE]

Each measurement is a fresh process (``--system`` runs another source tree, e.g. ``git archive``
of an older commit, with the same Python and packages; systems alternate within each repeat, the
order turning each round). The figure is the process's CPU time (every thread: the tokenizer's
too) per row, per part, after a warm-up batch of 256: ``tokenize`` (the stage's batch),
``engine`` (the engine stage over a batch: requests built, the fake engine's answers turned into
row columns, rows finished), ``output`` (the output stage's Arrow table of each chunk).
``--job``: the engine stage records answers as a job's does (``answer_tag``) and the output stage
is a job's. Where the tree has ``stages.runner.freeze_gc_heap``, it is called once the stages are
set up, as a processor's worker does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORDS = ("data engine batch model token river city market cloud shipping retail bank clinic school farm "
         "energy software hardware logistics travel insurance media games robot sensor invoice order customer").split()


def measure(rows: int, job: bool) -> dict:
    import torch

    from llmbatch.engines.settings import VLLMSettings
    from llmbatch.engines.vllm import VLLMEngine
    from llmbatch.rows import ROW_ID, STATS
    from llmbatch.stages.engine import EngineStage
    from llmbatch.stages.output import OutputStage
    from llmbatch.stages.tokenize import TokenizeStage

    rng = random.Random(0)
    batch = 256
    texts = [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) + "."
             for i in range(rows + batch)]

    class Pooled:  # the parts of vLLM's PoolingRequestOutput the engine reads
        def __init__(self, ids, vector):
            self.prompt_token_ids, self.num_cached_tokens, self.prompt = ids, 0, None
            self.outputs = type("PoolingOutput", (), {"data": vector})()

    vector = torch.nn.functional.normalize(torch.randn(384), dim=0)

    class AnswersAtOnce:
        errored = False

        async def encode(self, prompt, params, request_id, lora_request=None):
            yield Pooled(prompt["prompt_token_ids"], vector.clone())

    model = "all-minilm-l6-v2"
    engine = VLLMEngine(VLLMSettings(model_source=model, engine_kwargs={"max_model_len": 256}, task_type="embed"))
    engine.llm, engine.on_cpu, engine.max_model_len, engine.capacity = AnswersAtOnce(), True, 256, 256
    stage = EngineStage(engine, flush_rows=64, dedup_requests=False)  # every text is distinct anyway
    stage._ready_up()
    if job:
        stage.answer_tag = "bench"
    tokenize = TokenizeStage(model, {"max_model_len": 256}, task="embed")
    tokenize.ensure_setup()
    try:
        output = OutputStage(keep_private=(STATS, ROW_ID), for_job=job)
    except TypeError:  # an older tree: a job's rows left encoded for its driver
        output = OutputStage(keep_private=(STATS, ROW_ID), encoded=job)
    output = output.bind(task_type="embed", continue_on_error=True, postprocessed=False)
    try:  # as a processor's worker does once its stages have started, where the tree does it
        from llmbatch.stages.runner import freeze_gc_heap
    except ImportError:
        frozen = False
    else:
        freeze_gc_heap()
        frozen = True
    cpu = {"tokenize": 0.0, "engine": 0.0, "output": 0.0}

    async def one(rows_in: list[dict], counted: bool) -> None:
        t0 = time.process_time()
        tokenize.process_batch(rows_in)
        t1 = time.process_time()
        chunks = [chunk async for chunk in stage(rows_in)]
        t2 = time.process_time()
        for chunk in chunks:
            output.to_table(chunk)
        t3 = time.process_time()
        if counted:
            cpu["tokenize"] += t1 - t0
            cpu["engine"] += t2 - t1
            cpu["output"] += t3 - t2

    async def run() -> None:
        await one([{"prompt": texts[i], ROW_ID: i} for i in range(batch)], False)
        for start in range(batch, rows + batch, batch):
            await one([{"prompt": texts[i], ROW_ID: i} for i in range(start, min(start + batch, rows + batch))], True)

    asyncio.run(run())
    us = {k: v / rows * 1e6 for k, v in cpu.items()}
    return {"rows": rows, "job": job, "gc_frozen": frozen, "us_per_row": us, "outside_tokenizer_us": us["engine"] + us["output"],
            "total_us": sum(us.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=5120)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--job", action="store_true")
    p.add_argument("--system", action="append", default=[], help="LABEL=SRC: a source tree to run (default: this one)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.rows, args.job)))
        return
    systems = [s.split("=", 1) for s in args.system] or [["this", str(Path(__file__).resolve().parents[1] / "src")]]
    runs = []
    for rep in range(args.repeat):
        for label, src in systems if rep % 2 == 0 else systems[::-1]:
            env = {**os.environ, "PYTHONPATH": src}
            cmd = [sys.executable, __file__, "--child", "--rows", str(args.rows)] + (["--job"] if args.job else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            r.update(system=label, src=src, repeat=rep)
            runs.append(r)
            print(json.dumps(r), flush=True)
    summary = {}
    for label, _ in systems:
        mine = [r for r in runs if r["system"] == label]
        summary[label] = {key: statistics.median(r["us_per_row"][key] for r in mine) for key in mine[0]["us_per_row"]}
        summary[label]["outside_tokenizer_us"] = statistics.median(r["outside_tokenizer_us"] for r in mine)
        summary[label]["total_us"] = statistics.median(r["total_us"] for r in mine)
    print("\n| system | tokenize us/row | engine stage us/row | output us/row | outside the tokenizer | total |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, s in summary.items():
        print(f"| {label} | {s['tokenize']:.1f} | {s['engine']:.1f} | {s['output']:.1f} | "
              f"{s['outside_tokenizer_us']:.1f} | {s['total_us']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary, "command": [sys.executable, *sys.argv]},
                                             indent=1))


if __name__ == "__main__":
    main()
