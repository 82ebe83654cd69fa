#!/bin/bash
# GPU call 4 (issue 33): prompt attention alone at 4,096 and 32,768 tokens (the issue's 4k and
# 32k rows; 8k and 16k are in BENCHMARKS.md from 2026-11-28-flash), flash kernel with its default
# layout, dense bf16 keys and values, medians of 3 samples.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
gzip -dc kernel_bench.gz > /tmp/kernel_bench; chmod +x /tmp/kernel_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
timeout 170 /tmp/kernel_bench --backend cuda --section attention --tokens 4096,32768 --attention-kernels flash \
  --kv dense --reps 3 > $OUT/attention.md 2>&1
echo "rc $?" >> $OUT/attention.md
cat $OUT/attention.md | tail -20
