#!/usr/bin/env bash
# The seeds' industry job on the lent GPU machine (issue 29): bench/industry_gpu.py there.
#
# Here: ../shared/gpukit/pack_kit.sh (vLLM 0.26's wheels in .gpukit/send1..7), the Ray wheel in
# two parts (P/ray1, P/ray2) and a payload folder P/payload holding llmbatch's src, these bench
# scripts, the weight-less model folder (../shared/gpukit/make_models.py) and small wheels.
# There, in device calls back to back (the machine stays warm 30 s):
#   bash bench/industry_gpu.sh stage DIR...        # copy carried parts into /tmp/kit/parts
#   bash bench/industry_gpu.sh install PAYLOAD     # assemble, install into /tmp/site, samples
#   [SRC=DIR] bash bench/industry_gpu.sh run PAYLOAD SYSTEM ROWS OUTDIR [--set ...]
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
case "$1" in
stage)
  shift; mkdir -p /tmp/kit/parts
  for d in "$@"; do cp "$d"/* /tmp/kit/parts/; done
  ls -la /tmp/kit/parts | tail -n +2 | awk '{print $5, $9}'
  ;;
install)
  P=$2
  cd /tmp/kit && cat parts/kit.tar.part-* > kit.tar && tar xf kit.tar && cat parts/rayparts.* > ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl || exit 1
  sha256sum ray-2.60.0-*.whl
  cd - >/dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/kit/*.whl "$P"/wheels/*.whl 2>&1 | tail -3
  # bytecode once, on every core, as a user's pip install leaves it: without it a machine that
  # writes none compiles vLLM's sources in every process (each system's start alike)
  python3 -m compileall -q -j 0 /tmp/site "$P"/src >/dev/null 2>&1; echo "compiled: $?"
  export PYTHONPATH=/tmp/site:$P/src
  python3 -c "import vllm, ray, llmbatch, torch; print('vllm', vllm.__version__, 'ray', ray.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0), llmbatch.__file__)"
  mkdir -p /tmp/data
  # SAMPLES="": no sample files (a run that reads none, as bench/embed_gpu.sh)
  for n in ${SAMPLES-200000 2000000}; do python3 -m llmbatch sample /tmp/data/c$n.csv --rows $n --seed 0 & done; wait
  wc -l /tmp/data/*.csv
  ;;
run)
  P=$2; SYSTEM=$3; ROWS=$4; OUTDIR=$5; shift 5
  export PYTHONPATH=/tmp/site:${SRC:-$P/src}  # SRC: another llmbatch tree (an older commit's)
  IN=/tmp/data/c$ROWS.csv
  python3 "$P"/bench/industry_gpu.py --system "$SYSTEM" --model "$P"/models/llama31-8b-shape --input "$IN" \
      --rows "$ROWS" --out "$OUTDIR" "$@"
  ;;
esac
