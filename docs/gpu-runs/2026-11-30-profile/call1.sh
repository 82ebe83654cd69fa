#!/bin/bash
# GPU call (issue 34), nvidia-h200: where a decode token of Gemma 3 27B and Gemma 4 31B goes (ncu
# per kernel: time, DRAM bytes, issue activity, occupancy; scripts/kernel_bandwidth.py), synthetic
# models with q4 weights as the 1B/4B tables of 2026-11-29 (docs/gpu-runs/2026-11-29-rows call 1,
# whose 27B/31B windows ran out of time: 170 s for the load and 20 layers' worth of launches
# under ncu's replays). Here 290 s each and a window of 24 layers' launches after 30 layers'.
set -u
cd "$(dirname "$0")/../../.."
gzip -dc .gpu-bench/bench.gz > /tmp/burn-gemma-bench; chmod +x /tmp/burn-gemma-bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv > $OUT/env.txt
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size
for spec in gemma3-27b:62 gemma4-31b:60; do
  m=${spec%%:*}; L=${spec##*:}
  echo "[$(date +%T)] $m"
  timeout 290 ncu --csv --print-units base --clock-control none --metrics $M --launch-skip $((30 * L)) --launch-count $((24 * L)) \
    --log-file /tmp/ncu-$m.csv /tmp/burn-gemma-bench --model synthetic:$m --backend cuda --dtype bf16 --weights q4 \
    --prompt-len 1 --gen 64 --reps 1 > $OUT/ncu-$m-run.txt 2>&1; echo "rc $?" >> $OUT/ncu-$m-run.txt
  python3 .gpu-bench/kernel_bandwidth.py /tmp/ncu-$m.csv > $OUT/kernels-$m.md 2>&1
  gzip -c /tmp/ncu-$m.csv > $OUT/ncu-$m.csv.gz
  tail -2 $OUT/ncu-$m-run.txt | cut -c1-300; head -20 $OUT/kernels-$m.md
done
