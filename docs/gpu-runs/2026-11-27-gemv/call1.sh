#!/usr/bin/env bash
# Call 1: baseline decode of synthetic 12B (q4, q8 weights) and where a token's time goes (ncu
# per kernel: time, DRAM bytes, issue activity, occupancy), plus the detailed sections of the
# quantized GEMVs. Run from the repository root with .gpu-bench/ carried.
set -u
B=/tmp/b; mkdir -p $B
for e in bench kernel_bench; do gunzip -c .gpu-bench/$e.gz > $B/$e; chmod +x $B/$e; done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv > $OUT/env.txt
for w in q4 q8; do
  timeout 150 $B/bench --model synthetic:gemma3-12b --backend cuda --dtype bf16 --weights $w \
    --prompt-len 512 --gen 128 --reps 3 > $OUT/bench-12b-$w.txt 2>&1
done
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size
timeout 200 ncu --csv --print-units base --clock-control none --metrics $M --launch-skip 3000 --launch-count 700 \
  --log-file $OUT/ncu-12b-q4.csv $B/bench --model synthetic:gemma3-12b --backend cuda --dtype bf16 --weights q4 \
  --prompt-len 1 --gen 64 --reps 1 > $OUT/ncu-run.txt 2>&1
timeout 90 ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
  --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis --kernel-name regex:qgemv \
  --launch-skip 40 --launch-count 4 $B/bench --model synthetic:gemma3-12b --backend cuda --dtype bf16 --weights q4 \
  --prompt-len 1 --gen 16 --reps 1 > $OUT/ncu-qgemv-detail.txt 2>&1
ls -la $OUT
