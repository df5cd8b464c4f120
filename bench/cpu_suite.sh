#!/usr/bin/env bash
# The CPU table of bench/RESULTS.md: every workload, one after another, on this machine.
# usage: bash bench/cpu_suite.sh [OUTDIR]      (about an hour on 2 cores)
set -uo pipefail
OUT=${1:-bench-out}
mkdir -p "$OUT"
PY=${PYTHON:-python}
B="$(dirname "$0")/throughput.py"
$PY "$B" --workloads unique --rows 500 --systems vllm,llmbatch,ray --repeat 2 --json-out "$OUT/unique.json" | tee "$OUT/unique.md"
# small batches so that many batches pass through the replica (the regime of a large job)
$PY "$B" --workloads mixed --rows 240 --batch-size 16 --systems vllm,llmbatch,ray --json-out "$OUT/mixed.json" | tee "$OUT/mixed.md"
$PY "$B" --workloads customers --rows 500 --systems vllm,llmbatch,llmbatch-job,ray --json-out "$OUT/customers.json" | tee "$OUT/customers.md"
$PY "$B" --workloads duplicates --rows 400 --systems vllm,llmbatch --json-out "$OUT/duplicates.json" | tee "$OUT/duplicates.md"
$PY "$B" --workloads dates --rows 300 --systems vllm,llmbatch,ray --json-out "$OUT/dates.json" | tee "$OUT/dates.md"
