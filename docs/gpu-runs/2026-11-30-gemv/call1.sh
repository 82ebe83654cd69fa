#!/bin/bash
# Call 1: the quantized GEMV with one or two steps of weight loads in flight per unit.
# (1) quant kernel tests on CUDA (both pipelines); (2) kernel_bench decode table on 12B and 4B
# shapes, single then double; (3) bench, alternating.
set -u
cd "$(dirname "$0")"
for b in bench kernel_bench kernel_tests; do [ -f $b.gz ] && { gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; }; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261130 BURN_GEMMA_CACHE=/tmp/cache-ab
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt
if [ -f /tmp/kernel_tests ]; then
timeout 150 /tmp/kernel_tests --test-threads 1 quant::check > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result" $OUT/kernel-tests.txt | head
fi
for p in single double; do
  timeout 170 /tmp/kernel_bench --backend cuda --dtype bf16 --section decode --models ${KB_MODELS:-12b} --reps 10 --gemv-pipeline $p > $OUT/kb-$p.txt 2>&1; echo "rc $?" >> $OUT/kb-$p.txt
done
for p in single double; do echo "== $p"; grep -E "^\| q[48] |rc " $OUT/kb-$p.txt; done
