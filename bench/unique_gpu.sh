#!/usr/bin/env bash
# Issue 29's 10,000 unique prompts x 64 tokens on the lent GPU machine: plain vLLM against
# `llmbatch run` (its own process, the engine launched early as on any 8+ CPU machine), the
# Llama-3.1-8B shape with dummy weights, vLLM's H100 offline defaults pinned for both
# (max_num_seqs 1024, max_num_batched_tokens 16384), max_model_len 2048, batch_size 256.
# bench/throughput.py runs each system in a fresh process, interleaved, the order turning.
#
# Installed first with bench/industry_gpu.sh (stage, install); P holds src/, bench/, models/.
#   bash bench/unique_gpu.sh P OUTDIR warmup                 # untimed 200 rows, each system: caches
#   bash bench/unique_gpu.sh P OUTDIR rounds SYSTEMS N TAG   # N interleaved rounds in SYSTEMS' order
# Each writes OUTDIR/unique-*.json (raw runs), a log, and the start-up ledger (starts-*.jsonl).
# GPU_UTIL=1: every run samples nvidia-smi every 0.5 s into its JSON (`gpu_util`); TIMELINE=1: the
# whole call runs under bench/proc_timeline.py (every process's CPU seconds, OUTDIR/procs-TAG.json).
# On the lent machine keep OUTDIR in /tmp across calls (e.g. /tmp/res) and end each call with
# `tar czf $OUT/res.tgz -C /tmp/res .`: a call brings back at most 8 files, and $OUT starts empty.
set -uo pipefail
P=${1:?payload folder}; OUTDIR=${2:?output folder}; MODE=${3:?warmup or rounds}
export PYTHONPATH=/tmp/site:${SRC:-$P/src} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
unset RAY_ADDRESS
mkdir -p "$OUTDIR"
run() {  # ROWS SYSTEMS REPEAT TAG TIMEOUT
  local wrap=() gpu=""
  [ -n "${TIMELINE:-}" ] && wrap=(python3 "$P"/bench/proc_timeline.py "$OUTDIR/procs-$4.json" --every 0.5 --)
  [ -n "${GPU_UTIL:-}" ] && gpu=" --gpu-util"
  LLMBATCH_START_LOG=$OUTDIR/starts-$4.jsonl "${wrap[@]}" python3 "$P"/bench/throughput.py --device gpu --load-format dummy \
      --model "$P"/models/llama31-8b-shape --rows "$1" --max-model-len 2048 --batch-size 256 --workloads unique \
      --systems "$2" --repeat "$3" --timeout "$5" --json-out "$OUTDIR/unique-$1-$4.json" \
      --extra "--max-num-seqs 1024 --max-num-batched-tokens 16384$gpu" 2>&1 | tee "$OUTDIR/unique-$1-$4.log" | grep -v "^INFO"
}
case "$MODE" in
# (both systems: on 2026-11-29 plain vLLM's first run after llmbatch's warm-up alone was ready 15 s
# later than its warm runs, and was left out)
warmup) run 200 llmbatch-cli,vllm 1 warmup 240 ;;
rounds) run 10000 "${4:?systems}" "${5:?rounds}" "${6:?tag}" 200 ;;
esac
