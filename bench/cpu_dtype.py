"""Plain vLLM on this CPU in bfloat16 (vLLM's ``auto``) and float32, one process per dtype.

    python bench/cpu_dtype.py [--repeat 3] [--out bench/cpu-dtype.json]

Why llmbatch picks float32 on an x86 CPU without native bfloat16 (``engine_kwargs`` naming no
dtype, ``llmbatch.engines.vllm_setup.cpu_dtype``): such a CPU emulates bfloat16. Each run starts
``vllm.LLM`` on SmolLM2-135M-Instruct (eager, 256 MiB KV cache) and times 64 prompts x 64 tokens
(greedy, ``ignore_eos``) after one warm-up call. Runs alternate between the dtypes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def one(dtype: str) -> dict:
    from vllm import LLM, SamplingParams

    from llmbatch.engines.vllm_setup import native_bf16
    from llmbatch.models import prepare

    t0 = time.time()
    llm = LLM(model=str(prepare("smollm2-135m-instruct")), max_model_len=512, enforce_eager=True,
              kv_cache_memory_bytes=256 << 20, dtype=dtype)
    start_s = time.time() - t0
    llm.generate(["Hello there"] * 16, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    t = time.time()
    outs = llm.generate([f"Write about the number {i}." for i in range(64)],
                        SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    gen_s = time.time() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"dtype": dtype, "native_bf16": native_bf16(), "engine_start_s": round(start_s, 2),
            "generate_s": round(gen_s, 2), "tokens": tokens, "tokens_per_s": round(tokens / gen_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--one", default="")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one)), flush=True)
        return
    runs = []
    for _ in range(args.repeat):
        for dtype in ("bfloat16", "float32"):
            out = subprocess.run([sys.executable, __file__, "--one", dtype], capture_output=True, text=True)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            runs.append(json.loads(line[0][7:]) if line else {"dtype": dtype, "failed": out.stderr[-2000:]})
            print(json.dumps(runs[-1]), flush=True)
    table = {}
    for dtype in ("bfloat16", "float32"):
        ok = [r["tokens_per_s"] for r in runs if r["dtype"] == dtype and "tokens_per_s" in r]
        if ok:
            table[dtype] = {"runs": len(ok), "tokens_per_s_median": statistics.median(ok), "min": min(ok), "max": max(ok)}
    print(json.dumps(table, indent=1))
    if args.out:
        json.dump({"runs": runs, "summary": table}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
