#!/usr/bin/env bash
# Call 1: the expert kernels' tests on the H200 (routed, grouped and batched; f32 and bf16; a fixed
# seed then a fresh one), then one 26B-A4B experts layer by each path at several token counts.
set -u
here=$PWD/.gpu-bench
export BURN_GEMMA_CACHE=/tmp/bgcache
gzip -dc $here/kernel_tests.gz > /tmp/kernel_tests && chmod +x /tmp/kernel_tests
gzip -dc $here/kernel_bench.gz > /tmp/kernel_bench && chmod +x /tmp/kernel_bench
for seed in 20261125 fresh; do
  if [ $seed = fresh ]; then unset BURN_GEMMA_TEST_SEED; else export BURN_GEMMA_TEST_SEED=$seed; fi
  /tmp/kernel_tests experts --test-threads 1 --nocapture > $OUT/kernel-tests-$seed.txt 2>&1
  echo "seed $seed: rc $?"; grep -E "test result|FAILED|panicked" $OUT/kernel-tests-$seed.txt | head -5
done
unset BURN_GEMMA_TEST_SEED
/tmp/kernel_bench --backend cuda --dtype bf16 --section experts --rows 16,64,128,256,512,2048 --reps 5 > $OUT/experts-layer.txt 2>> $OUT/log.txt
echo "bench rc $?"; cat $OUT/experts-layer.txt
