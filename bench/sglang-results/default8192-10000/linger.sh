#!/bin/bash
# after an llmbatch-sglang run: what is left of its replica, every 15 s for ~3 min
PS=$(dirname "$0")/py-spy
for i in $(seq 0 12); do
  echo "=== $(date +%T) t=$((i*15))s"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
  ps -eo pid,ppid,etimes,stat,nlwp,wchan:30,args | grep -E "MapWorker|sglang::|ray::|raylet|gcs_server|StageRunner" | grep -v grep
  for p in $(pgrep -f "MapWorker"); do
    echo "--- pid $p threads: $(ls /proc/$p/task | wc -l)"
    for t in /proc/$p/task/*; do echo "$(cat $t/comm) $(cat $t/wchan 2>/dev/null) $(awk '{print $3}' $t/stat)"; done | sort | uniq -c | head -40
    [ $i -lt 3 ] || [ $i -eq 8 ] && timeout 20 "$PS" dump --pid $p 2>&1 | head -150
  done
  [ -z "$(pgrep -f MapWorker)" ] && { echo "no MapWorker left"; break; }
  sleep 15
done
