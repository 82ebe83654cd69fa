#!/usr/bin/env bash
# Call 1: the quantized mma kernel against its reference (bf16, f16), the quantized and GELU
# product tests through `project` (bf16), then the products of a batched step by rows and
# tiling (4B shapes), then the 4B step alone by rows (our Q4 and Q8 quantized at load).
set -u
here=$PWD/.gpu-bench
cd /tmp
for b in ktests kernel_bench serve_bench; do gzip -dc $here/$b.gz > /tmp/$b && chmod +x /tmp/$b; done
date
/tmp/ktests --test-threads 1 mma_matches_reference quantized_matches_host::cuda_bf16 project_gelu_pairs_matches_host::cuda_bf16 > $OUT/kernel-tests.txt 2>&1
echo "kernel tests rc $?"; grep -E "test result|FAILED|panicked" $OUT/kernel-tests.txt | head; date
/tmp/kernel_bench --backend cuda --dtype bf16 --section batched --models 4b --rows 1,4,8,9,16,32,64 --reps 10 > $OUT/batched.txt 2>&1
echo "batched rc $?"; date
timeout 200 /tmp/kernel_bench --backend cuda --dtype bf16 --section batched --models 4b --rows 16,32,64 --gemm-kernels all --reps 5 > $OUT/batched-tilings.txt 2>&1
echo "tilings rc $?"; date
