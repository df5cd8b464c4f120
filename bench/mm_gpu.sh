#!/bin/bash
# Issue 11's image runs on the lent GPU machine, after `bash bench/gpu_bench.sh install`
# (carry [".gpukit/llmbatch", ".gpukit/mm"]; the model is `python bench/make_vlm_shape.py .gpukit/mm/qwen25vl-3b-shape`).
#   bash bench/mm_gpu.sh warm        # both systems on 50 images: bytecode and both compile caches warm (their keys differ)
#   bash bench/mm_gpu.sh diag        # one llmbatch run; its phases, the replica's log and the import times
#   bash bench/mm_gpu.sh repeat K    # repeat K of both systems (even K: vllm first), mm-2000-rK.json
# Everything lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 VLLM_LOGGING_LEVEL=INFO PYTHONUNBUFFERED=1
ARGS=(--model .gpukit/mm/qwen25vl-3b-shape --device gpu --load-format dummy)

keep_logs() {  # the replica's engine log and Ray's worker logs of the last run
  mkdir -p "$OUT/$1"
  cp /tmp/ray/session_latest/logs/llmbatch-engine-*.log "$OUT/$1/" 2>/dev/null
  grep -l "StageRunner\|llmbatch" /tmp/ray/session_latest/logs/worker-*.{out,err} 2>/dev/null | head -4 |
    xargs -r -I{} cp {} "$OUT/$1/"
}

phases() {  # seconds from the process start to each phase of llmbatch's runs in a result file
  python3 - "$1" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    if r.get("system") != "llmbatch" or "error" in r:
        continue
    keys = ("ray_ready_at", "execute_at", "process_start_at", "begin_at", "replica_start_at", "ready_at",
            "first_request_at", "done_at")
    print("llmbatch r%s:" % r.get("repeat"), ", ".join(f"{k[:-3]} {r[k] - r['started_at']:.1f}" for k in keys if r.get(k)))
EOF
}

case "${1:-}" in
warm)
  timeout 590 python3 bench/mm_bench.py "${ARGS[@]}" --rows 50 --repeats 1 --systems vllm,llmbatch --json "$OUT/warm.json" 2>&1 | tail -5
  ;;
diag)
  timeout 400 python3 bench/mm_bench.py "${ARGS[@]}" --rows 2000 --repeats 1 --systems llmbatch --json "$OUT/diag.json" 2>&1 | tail -5
  phases "$OUT/diag.json"
  keep_logs diag
  for what in "import vllm" "import vllm; from vllm.v1.engine.async_llm import AsyncLLM" "import ray; import llmbatch.stages.runner" \
              "import transformers; from transformers import AutoProcessor"; do
    /usr/bin/time -f "%e s: $what" python3 -c "$what" 2>&1 | tail -1
  done
  python3 -c "import time, ray; t = time.time(); ray.init(include_dashboard=False, logging_level='WARNING'); print(f'{time.time() - t:.1f} s: ray.init'); ray.shutdown()" 2>&1 | tail -1
  ;;
repeat)
  timeout 590 python3 bench/mm_bench.py "${ARGS[@]}" --rows 2000 --repeats 1 --start-repeat "$2" --json "$OUT/mm-2000-r$2.json" 2>&1 | tail -6
  phases "$OUT/mm-2000-r$2.json"
  keep_logs "r$2"
  ;;
*)
  echo "usage: $0 warm | diag | repeat K"; exit 2
  ;;
esac
