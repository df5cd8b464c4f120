#!/usr/bin/env bash
# The CPU tables of bench/RESULTS.md on the method (issue 14): every workload but "unique"
# (bench/cpu-results/method-v2/unique-500.json has its own call), three interleaved rounds each,
# the order turning each round, engine settings pinned identical for every system.
# usage: PYTHON=.venv/bin/python bash bench/cpu_suite.sh [OUTDIR]    (about 85 minutes on 2 cores)
set -uo pipefail
OUT=${1:-bench-out}
mkdir -p "$OUT"
PY=${PYTHON:-python}
B="$(dirname "$0")/throughput.py"
run() { local name=$1; shift; $PY "$B" --repeat 3 --json-out "$OUT/$name.json" "$@" | tee "$OUT/$name.md"; }
run customers-500 --workloads customers --rows 500 --systems vllm,llmbatch,llmbatch-job,ray
run duplicates-400 --workloads duplicates --rows 400 --systems vllm,llmbatch,llmbatch-job
run dates-300 --workloads dates --rows 300 --systems vllm,llmbatch,ray
# small batches so that many batches pass through the replica (the regime of a large job)
run mixed-120 --workloads mixed --rows 120 --batch-size 16 --systems vllm,llmbatch,ray
