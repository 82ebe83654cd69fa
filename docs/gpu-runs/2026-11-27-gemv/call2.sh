#!/usr/bin/env bash
# Call 2: the split quantized GEMV (row groups over several planes) against the previous build
# (prev/bench.gz), Gemma 3 12B shapes with 8 of its 48 layers (bench --layers 8), q4 and q8,
# alternating; the kernel tests of the quantized products through CUDA; ncu per kernel of the
# new build; the PTX of the GEMVs (graph cache) for reading.
set -u
B=/tmp/b; mkdir -p $B
gunzip -c .gpu-bench/bench.gz > $B/new; gunzip -c .gpu-bench/prev/bench.gz > $B/old
gunzip -c .gpu-bench/kernel_tests.gz > $B/kt; chmod +x $B/*
timeout 150 $B/kt quantized_matches_host project_gelu_pairs --test-threads 1 > $OUT/kernel-tests.txt 2>&1
echo "rc=$?" >> $OUT/kernel-tests.txt
for w in q4 q8; do
  for v in old new old new; do
    echo "== $v $w" >> $OUT/ab.txt
    timeout 100 $B/$v --model synthetic:gemma3-12b --layers 8 --backend cuda --dtype bf16 --weights $w \
      --prompt-len 1 --gen 128 --reps 3 2>&1 | grep -E "JSON|decode time|error|Error" >> $OUT/ab.txt
  done
done
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size
timeout 120 ncu --csv --print-units base --clock-control none --metrics $M --launch-skip 600 --launch-count 300 \
  --log-file $OUT/ncu-new-q4.csv $B/new --model synthetic:gemma3-12b --layers 8 --backend cuda --dtype bf16 --weights q4 \
  --prompt-len 1 --gen 64 --reps 1 > $OUT/ncu-run.txt 2>&1
mkdir -p $OUT/ptx; grep -l "qgemv" ~/.cache/burn-gemma/ptx/*.ptx 2>/dev/null | head -8 | xargs -r -I{} cp {} $OUT/ptx/
ls ~/.cache/burn-gemma/ptx | wc -l >> $OUT/ab.txt
