#!/bin/bash
# A job SIGKILLed mid-run (at >= 1500 of 4000 committed rows) and resumed: how many requests
# reached the engine, against the distinct prompts. bench/resume_answers.sh SRC OUTDIR (SRC: an
# llmbatch source tree, e.g. a git worktree of an older commit, for a before/after).
set -u
SRC=$1; OUT=$2
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
rm -rf "$OUT"; mkdir -p "$OUT"; cd "$OUT"
PYTHONPATH=$SRC $PY -c "from llmbatch.sample_data import write_customers_csv; write_customers_csv('c.csv', 4000, seed=0)"
PYTHONPATH=$SRC setsid $PY -m llmbatch run --input c.csv --id-column Index -m smollm2-135m-instruct --prompt "Which industry is {Company} in? One word." --max-tokens 4 --temperature 0 --output out.parquet --quiet --set model.engine_kwargs.max_model_len=512 --set model.batch_size=64 --set commit_seconds=0.5 > run1.log 2>&1 &
PID=$!
for i in $(seq 1 600); do
  n=$($PY -c "
import glob,pyarrow.parquet as pq
print(sum(pq.read_metadata(p).num_rows for p in glob.glob('out.parquet.job/parts/*.parquet')))" 2>/dev/null || echo 0)
  if [ "${n:-0}" -ge 1500 ]; then break; fi
  sleep 0.5
done
kill -9 -- -$PID; wait $PID 2>/dev/null
echo "killed at $n committed"
PYTHONPATH=$SRC $PY -m llmbatch resume out.parquet.job --quiet > run2.log 2>&1; echo "resume rc=$?"
$PY - <<'PY'
import glob, pyarrow as pa, pyarrow.parquet as pq, csv
rows = pa.concat_tables([pq.read_table(p, columns=["__llmbatch_id", "__llmbatch_stats"]) for p in sorted(glob.glob('out.parquet.job/parts/*.parquet'))], promote_options="permissive").to_pylist()
sent = sum(1 for r in rows if r["__llmbatch_stats"] and not r["__llmbatch_stats"]["deduped"])
distinct = len({r["Company"] for r in csv.DictReader(open("c.csv"))})
ids = [r["__llmbatch_id"] for r in rows]
print({"rows_committed": len(rows), "unique_ids": len(set(ids)), "requests_to_engine": sent, "distinct_prompts": distinct, "ratio": round(sent / distinct, 3)})
PY
