#!/usr/bin/env bash
# `llmbatch plan` on a generated 2,000,000-row customers CSV: time and peak memory.
# usage: bash bench/plan_memory.sh [WORKDIR]
set -euo pipefail
W=${1:-/tmp/llmbatch-plan-2m}
mkdir -p "$W"
[ -f "$W/customers.csv" ] || llmbatch sample "$W/customers.csv" --rows 2000000 --seed 0
cat > "$W/job.yaml" <<'YAML'
input: {path: customers.csv, id_column: Index}
model: {source: smollm2-135m-instruct, engine_kwargs: {max_model_len: 512}}
prompt:
  system: You classify companies by industry. Answer with the industry only.
  user: "Which industry is the company '{Company}' in?"
  choices: [Law Firm, Retail, Technology, Finance, Other]
sampling_params: {temperature: 0, max_tokens: 8}
output: {path: out.parquet}
YAML
ls -la "$W/customers.csv"
/usr/bin/time -v llmbatch plan "$W/job.yaml" --json --throughput 25 2> "$W/time.txt" | tee "$W/plan.json"
grep -E "Maximum resident|Elapsed" "$W/time.txt"
