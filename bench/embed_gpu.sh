#!/usr/bin/env bash
# Issue 29's embeddings criterion on the lent GPU machine: all-MiniLM-L6-v2, 200,000 texts,
# llmbatch against plain vLLM `LLM.embed`, whole process (process start to the output file
# closed), 3 interleaved rounds after one untimed warm-up run of each system; median and
# min-max in bench/embed_bench.py's table, raw JSON in OUTDIR.
#
# Here: the model folder in float16 at .gpukit/minilm (carried; it arrives at the repo root);
# P holds llmbatch's src/ and bench/; vLLM and Ray installed under /tmp/site
# (bench/industry_gpu.sh install).
#   [MODEL=DIR] [ROWS=200000] [REPEATS=3] bash bench/embed_gpu.sh P OUTDIR [embed_bench.py flags...]
set -uo pipefail
P=${1:?payload folder (src/, bench/)}; OUTDIR=${2:?output folder}; shift 2
MODEL=${MODEL:-$PWD/.gpukit/minilm}; ROWS=${ROWS:-200000}; REPEATS=${REPEATS:-3}
# rounds split over device calls (600 s each): WARMUP=0 after the first, SYSTEMS=llmbatch,vllm to
# turn the order, TAG to keep each call's JSON; SRC: another llmbatch tree (its src/) for every system
WARMUP=${WARMUP:-1}; SYSTEMS=${SYSTEMS:-vllm,llmbatch}; TAG=${TAG:-}
# vLLM 0.26 on the kit has no flashinfer: its sampler check imports it unless told not to
# (bench/industry_gpu.sh sets the same; without it every engine start failed there)
export PYTHONPATH=/tmp/site:${SRC:-$P/src} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
unset RAY_ADDRESS
mkdir -p "$OUTDIR"
OUT=$OUTDIR/embed-gpu-$ROWS$TAG.json
python3 "$P"/bench/embed_bench.py --device gpu --model "$MODEL" --rows "$ROWS" --repeats "$REPEATS" \
    $([ "$WARMUP" = 1 ] && echo --warmup) --systems "$SYSTEMS" --json "$OUT" "$@" 2>&1 | tee "$OUTDIR"/embed-gpu-$ROWS$TAG.log
rc=${PIPESTATUS[0]}
python3 - "$OUT" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
walls = {s: (v["wall_s"]["median"], v["wall_s"]["min"], v["wall_s"]["max"]) if v["wall_s"] else None
         for s, v in r["summary"].items()}
gpu = next((x.get("gpu") for x in r["runs"] if x.get("gpu")), "?")
print("SUMMARY", f"rows={r['rows']}", f"gpu={gpu}", f"warmup={r['warmup']['done']}",
      " ".join(f"{s}_wall_median={w[0]:.1f}s({w[1]:.1f}-{w[2]:.1f})" if w else f"{s}=failed" for s, w in walls.items()),
      *(f"ratio_{s}_vs_vllm={ratio.get('wall', float('nan')):.3f} per_round="
        f"{[round(x, 3) if x else None for x in ratio.get('wall_per_round', [])]}" for s, ratio in r["ratios_vs_vllm"].items()),
      f"min_cosine={r['min_cosine_vs_vllm']}", f"json={sys.argv[1]}")
PY
exit $rc
