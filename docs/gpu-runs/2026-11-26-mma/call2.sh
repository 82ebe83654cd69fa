#!/usr/bin/env bash
# Call 2: the double-buffered quantized mma kernel against its reference (bf16, f16), then the
# batched products by graph replay (4B shapes): `project` at 1-64 rows, every tiling at 4, 16, 64.
set -u
here=$PWD/.gpu-bench
cd /tmp
for b in ktests kernel_bench; do gzip -dc $here/$b.gz > /tmp/$b && chmod +x /tmp/$b; done
date
/tmp/ktests --test-threads 1 mma_matches_reference > $OUT/kernel-tests.txt 2>&1
echo "kernel tests rc $?"; grep -E "test result|FAILED|panicked" $OUT/kernel-tests.txt | head; date
/tmp/kernel_bench --backend cuda --dtype bf16 --section batched --models 4b --rows 1,2,3,4,8,9,16,32,64 --reps 10 > $OUT/batched.txt 2>&1
echo "batched rc $?"; date
timeout 330 /tmp/kernel_bench --backend cuda --dtype bf16 --section batched --models 4b --rows 4,16,64 --gemm-kernels all --reps 5 > $OUT/batched-tilings.txt 2>&1
echo "tilings rc $?"; date
