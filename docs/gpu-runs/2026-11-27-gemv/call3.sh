#!/usr/bin/env bash
# Call 3: kernel tests through CUDA (quantized products with the split GEMV, GELU pairs, the
# RMSNorms with the add-norm's loads issued up front), ncu per kernel of this build on Gemma 3
# 12B shapes (8 of 48 layers, q4), then decode against the previous build (prev/bench.gz),
# alternating, q4 then q8.
set -u
B=/tmp/b; mkdir -p $B
gunzip -c .gpu-bench/bench.gz > $B/new; gunzip -c .gpu-bench/prev/bench.gz > $B/old
gunzip -c .gpu-bench/kernel_tests.gz > $B/kt; chmod +x $B/*
timeout 150 $B/kt quantized_matches_host project_gelu_pairs rms_norm --test-threads 1 > $OUT/kernel-tests.txt 2>&1
echo "rc=$?" >> $OUT/kernel-tests.txt
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size
timeout 90 ncu --csv --print-units base --clock-control none --metrics $M --launch-skip 600 --launch-count 240 \
  --log-file $OUT/ncu-new-q4.csv $B/new --model synthetic:gemma3-12b --layers 8 --backend cuda --dtype bf16 \
  --weights q4 --prompt-len 1 --gen 16 --reps 1 > $OUT/ncu-run-new-q4.txt 2>&1
for run in old:q4 new:q4 old:q4 new:q4 old:q8 new:q8; do
  IFS=: read -r v w <<< "$run"
  echo "== $v $w" >> $OUT/ab.txt
  timeout 60 $B/$v --model synthetic:gemma3-12b --layers 8 --backend cuda --dtype bf16 --weights $w \
    --prompt-len 1 --gen 128 --reps 3 2>&1 | grep -E "JSON|decode time|error|Error" >> $OUT/ab.txt
done
