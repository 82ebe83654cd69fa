#!/bin/bash
# Call 5 (issue 34): per-kernel times of a 1B q4 decode token's lm_head and choice, ncu one
# kernel at a time, prev (651ed46: LM head GEMV, chunk_stats, sample) against new (d643ff0:
# head_greedy GEMV, pick), the Q4/Q8 GEMVs of the token beside them for scale.
set -u
cd "$(dirname "$0")"
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
gzip -dc bench.gz > /tmp/new; gzip -dc prev/bench.gz > /tmp/prev; chmod +x /tmp/new /tmp/prev
for b in prev new; do
  k='regex:qgemv|head_greedy|pick_kernel|chunk_stats|sample_kernel'
  timeout 100 ncu --csv --print-units base --metrics gpu__time_duration.sum --clock-control none -k "$k" \
    --launch-count 400 --log-file $OUT/ncu-$b.csv /tmp/$b --model synthetic:gemma3-1b --backend cuda --dtype bf16 \
    --weights q4 --prompt-len 1 --gen 8 --depth 0 --reps 1 > $OUT/run-$b.txt 2>&1; echo "$b rc $?"
done
python3 - "$OUT" <<'PY'
import csv, sys, statistics, collections, os
out = sys.argv[1]
for b in ("prev", "new"):
    path = os.path.join(out, f"ncu-{b}.csv")
    if not os.path.exists(path):
        print(b, "no csv"); continue
    lines = [l for l in open(path) if l.startswith('"')]
    rows = list(csv.DictReader(lines))
    times = collections.defaultdict(list)
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum": continue
        name = r["Kernel Name"].split("(")[0].split("<")[0]
        times[(name, r["Grid Size"], r["Block Size"])].append(float(r["Metric Value"]) / 1e3)
    print(f"== {b}: kernel, grid, block, launches, median us")
    for key, v in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"{key[0]:<40} {key[1]:<16} {key[2]:<14} {len(v):4d} {statistics.median(v):9.2f}")
PY
date +%T
