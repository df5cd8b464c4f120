#!/usr/bin/env bash
# Two GPUs (issue 14): one replica, two replicas (concurrency=2) and one replica on both GPUs
# (tensor_parallel_size=2), each run in its own process, GPU utilisation sampled every 0.5 s.
# On the lent nvidia-h200-x2 after `bash bench/gpu_bench.sh install`, llmbatch's src first:
#   bash bench/gpu_scaling.sh OUTDIR warm x1 x2 tp2 ...     (each name one run, in that order)
# then here: python bench/scaling.py OUTDIR/*.json
set -uo pipefail
OUT=$1; shift
mkdir -p "$OUT"
MODEL=${MODEL:-.gpukit/llmbatch/models/llama31-8b-shape}
ROWS=${ROWS:-20000}
# vLLM's offline defaults on an H100/H200, pinned for every configuration
PIN="--max-num-seqs 1024 --max-num-batched-tokens 16384"
run() {  # name rows system extra...
  local name=$1 rows=$2 system=$3; shift 3
  python3 bench/throughput.py --device gpu --load-format dummy --model "$MODEL" --rows "$rows" \
      --max-model-len 2048 --batch-size 256 --workloads unique --systems "$system" --repeat 1 --timeout 540 \
      --json-out "$OUT/$name-$(date +%H%M%S).json" --extra "$PIN --gpu-util $*" | grep -v '^$'
}
for cfg in "$@"; do
  case "$cfg" in
    warm) run warm 200 vllm ;;  # fills the compile cache for these settings (not counted)
    x1) run x1 "$ROWS" llmbatch --concurrency 1 ;;
    x2) run x2 "$ROWS" llmbatch --concurrency 2 ;;
    tp2) run tp2 "$ROWS" llmbatch --concurrency 1 --tensor-parallel-size 2 ;;
    *) echo "unknown configuration $cfg"; exit 2 ;;
  esac
done
