#!/bin/bash
# The SGLang kit's steps on the GPU machine, one per device call (see README.md).
#   bash bench/sglang_kit/device.sh part K        # copy the carried .sgkit/sendK to /tmp/kit/parts
#   bash bench/sglang_kit/device.sh install       # assemble, check, install into /tmp/site-{sg,base,vllm}
#   bash bench/sglang_kit/device.sh checks        # (a) industry flow, (b) kill mid-run; logs in $OUT
#   bash bench/sglang_kit/device.sh bench [ROWS] [WORKLOAD]   # (c) sglang_bench.py; results in $OUT
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
REPO=$(pwd)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 \
       VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false
SG=/tmp/site-sg:/tmp/site-base
MODEL=/tmp/kit/models/${MODEL_SHAPE:-llama31-8b-shape}

gpu_state() {  # what holds the GPU now, and any engine process left
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
  ps -eo pid,ppid,etimes,args | grep -E "sglang::|VLLM|EngineCore|ray::" | grep -v grep || true
}

case "${1:-}" in
part)
  mkdir -p /tmp/kit/parts && cp .sgkit/send"$2"/* /tmp/kit/parts/ && ls -la /tmp/kit/parts | tail -n +2
  ;;
install)
  cd /tmp/kit || exit 1
  cat parts/kit.tar.part-* > kit.tar && sha256sum -c parts/kit.sha256 && tar xf kit.tar && rm -f kit.tar || exit 1
  for d in sg base vllm; do
    [ -d "$d" ] || continue
    t0=$(date +%s)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$d" "$d"/*.whl 2>&1 | grep -v -e "^WARNING: Target directory" -e "Running pip as the 'root' user" | tail -3
    echo "installed $d ($(ls "$d"/*.whl | wc -l) wheels) in $(( $(date +%s) - t0 )) s"
  done
  cd "$REPO"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  PYTHONPATH=$SG:$REPO/src python3 -c "
import torch, sglang, sgl_kernel, xgrammar, transformers, ray, llmbatch
from sgl_kernel import flash_ops
import importlib
for m in ('sglang.srt.entrypoints.engine', 'sglang.srt.managers.scheduler', 'sglang.srt.managers.detokenizer_manager',
          'sglang.srt.model_executor.model_runner', 'sglang.srt.models.llama', 'sglang.srt.models.qwen2',
          'sglang.srt.layers.attention.flashattention_backend', 'sglang.srt.layers.attention.triton_backend',
          'sglang.srt.constrained.xgrammar_backend', 'sglang.srt.layers.sampler'):
    importlib.import_module(m)
print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__, torch.cuda.get_device_name(0))
from llmbatch.engines.sglang import check_sglang_build; check_sglang_build(); print('llmbatch build check ok')" 2>&1 | tail -15 | tee "$OUT/import-sglang.txt"
  if [ -d /tmp/site-vllm ]; then
    PYTHONPATH=/tmp/site-vllm:/tmp/site-base:$REPO/src python3 -c "import vllm, ray, llmbatch; print('vllm', vllm.__version__)" 2>&1 | tail -2 | tee "$OUT/import-vllm.txt"
  fi
  ;;
checks)
  export PYTHONPATH=$SG:$REPO/src
  echo "== (a) industry flow on SGLang"
  timeout 270 python3 bench/sglang_kit/industry_check.py --model "$MODEL" --rows "${ROWS_A:-3000}" --out "$OUT/flow" \
      > "$OUT/flow.log" 2>&1; echo "exit $?"; tail -c 2500 "$OUT/flow.log"
  gpu_state | tee "$OUT/after-flow.txt"
  echo "== (b) SGLang scheduler killed mid-run"
  timeout 290 python3 bench/sglang_kit/industry_check.py --model "$MODEL" --rows "${ROWS_B:-20000}" --out "$OUT/kill" \
      --kill-after-rows "${KILL_AFTER:-3000}" --no-dedup > "$OUT/kill.log" 2>&1; echo "exit $?"; tail -c 2500 "$OUT/kill.log"
  gpu_state | tee "$OUT/after-kill.txt"
  cp /tmp/ray/session_latest/logs/llmbatch-engine-*.log "$OUT/" 2>/dev/null || true
  ;;
bench)
  paths="--path sglang=$SG"
  [ -d /tmp/site-vllm ] && paths="$paths --path vllm=/tmp/site-vllm:/tmp/site-base"
  timeout 590 python3 bench/sglang_bench.py --model "$MODEL" --rows "${2:-2000}" --workload "${3:-unique}" \
      --repeat "${REPEAT:-3}" --systems "${SYSTEMS:-sglang,llmbatch-sglang,llmbatch-vllm}" --budget "${BUDGET:-480}" \
      --sglang-kwargs "${SGLANG_KWARGS_JSON:-{\}}" $paths --out "$OUT/bench" 2>&1 | tail -40
  gpu_state | tee "$OUT/after-bench.txt"
  ;;
*)
  echo "usage: $0 part K | install | checks | bench [ROWS] [WORKLOAD]"; exit 2
  ;;
esac
