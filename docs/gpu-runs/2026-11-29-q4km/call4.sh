#!/bin/bash
# GPU call 4 (carries the last chunk and kernel_bench in .gpu-kb): the prefill products at 512 and
# 4,096 rows (4B, 12B and Gemma 4 31B shapes) as the tuner runs them, TFLOP/s against the H200's
# bf16 rate.
set -u
cd "$(dirname "$0")/../../.."
bash docs/gpu-runs/2026-11-29-q4km/chunk.sh
gzip -dc .gpu-kb/kernel_bench.gz > /tmp/burn-gemma-kernel-bench && chmod +x /tmp/burn-gemma-kernel-bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
BURN_GEMMA_CACHE=/tmp/cache-gemm timeout 240 /tmp/burn-gemma-kernel-bench --backend cuda --dtype bf16 --section gemm \
  --models 4b,12b,31b --rows 512,4096 --reps 10 > $OUT/gemm.txt 2>&1; echo "rc $?" >> $OUT/gemm.txt
grep -E "project|rc " $OUT/gemm.txt | head -40
