#!/usr/bin/env bash
# GPU figures for bench/RESULTS.md, on the lent GPU machine (no internet there).
#
# Before: ../shared/gpukit/pack_kit.sh carried vLLM 0.26's wheels in parts to /tmp/kit/parts;
# the Ray wheel came in parts to /tmp/kit/ray; .gpukit/llmbatch holds llmbatch's wheel, a few
# small wheels and the weight-less model folders made by ../shared/gpukit/make_models.py.
#   bash bench/gpu_bench.sh install              # assemble and install into /tmp/site
#   bash bench/gpu_bench.sh run MODEL ROWS WORKLOADS SYSTEMS OUTDIR
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
case "$1" in
install)
  cd /tmp/kit && cat parts/kit.tar.part-* > kit.tar && tar xf kit.tar && cat ray/ray.whl.part-* > ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl || exit 1
  cd - >/dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/kit/*.whl .gpukit/llmbatch/*.whl 2>&1 | tail -3
  python3 -c "import vllm, ray, llmbatch, torch; print('vllm', vllm.__version__, 'ray', ray.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
  ;;
run)
  MODEL=$2; ROWS=$3; WORKLOADS=$4; SYSTEMS=$5; OUTDIR=$6
  python3 bench/throughput.py --device gpu --load-format dummy --model "$MODEL" --rows "$ROWS" \
      --max-model-len 2048 --batch-size 256 --workloads "$WORKLOADS" --systems "$SYSTEMS" \
      --json-out "$OUTDIR/$(basename "$MODEL")-$(echo "$WORKLOADS" | tr , -).json" --timeout 480
  ;;
esac
