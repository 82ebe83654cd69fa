#!/bin/bash
# Call 1 (issue 34): the add + RMSNorm fused into the gate|up GEMV's prologue
# (quant::normed_gemv, commit fd2b19a) against the build before it (prev/bench.gz, commit
# 5ac677d: add_rms_norm then the quantized GEMV). (1) The fused kernel's tests on CUDA (f32,
# bf16) with the fixed CI seed; (2) bench, alternating builds twice, random weights, bf16, tg128
# after a 512-token prompt, medians of 3 per run.
set -u
cd "$(dirname "$0")"
for b in bench kernel_tests; do gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; done
gzip -dc prev/bench.gz > /tmp/prev-bench; chmod +x /tmp/prev-bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_CACHE=/tmp/cache-ab
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
BURN_GEMMA_TEST_SEED=20261130 timeout 150 /tmp/kernel_tests --test-threads 2 normed_gemv > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result|panicked|seed" $OUT/kernel-tests.txt | head
SPECS=${SPECS:-"gemma3-12b:q4:16 gemma3-4b:q8:0 gemma3-1b:q4:0"}
for round in 1 2; do
for spec in $SPECS; do
  IFS=: read model w layers <<< "$spec"
  la=(); [ "$layers" != 0 ] && la=(--layers $layers)
  for b in prev new; do
    exe=/tmp/bench; [ $b = prev ] && exe=/tmp/prev-bench
    echo "== $b $model $w ${la[*]} round $round $(date +%T)" >> $OUT/ab.txt
    timeout 75 $exe --model synthetic:$model --backend cuda --dtype bf16 --weights $w "${la[@]}" --prompt-len 512 --gen 128 --reps 3 >> $OUT/ab.txt 2>&1 || echo "failed rc $?" >> $OUT/ab.txt
  done
done
done
grep -E "^==|decode tg|failed" $OUT/ab.txt; date +%T
