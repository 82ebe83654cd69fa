#!/bin/bash
# Call 4 (right after call 3, same warm machine): decode beside llama.cpp on the 27B Q4_K_M
# file written in call 2 (llama-bench tg128, F16 and q8_0 KV; ours bf16 and int8 KV; depths 512
# and 8192; medians of 3), ours the build of commit 5ac677d (prev/bench.gz).
set -u
cd "$(dirname "$0")"
cp prev/bench.gz bench.gz
QSTEMS=${QSTEMS:-"27b-Q4_K_M"} REPS=3 QDEPTHS="512 8192" timeout ${Q_LIMIT:-330} bash bench-gpu.sh quant > /dev/null 2>&1
tail -16 $OUT/quant.md 2>/dev/null; tail -3 $OUT/log.txt; date +%T
# The quantized GEMV after the block_product mend (commit 5ac677d's kernels) and the routed-expert
# GEMV against their references on CUDA (f32, bf16), the fixed CI seed.
gzip -dc kernel_tests.gz > /tmp/kernel_tests; chmod +x /tmp/kernel_tests
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
BURN_GEMMA_TEST_SEED=20261130 timeout ${KT_LIMIT:-190} /tmp/kernel_tests --test-threads 4 quant::check::gpu experts::gemv > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result|panicked" $OUT/kernel-tests.txt | head -20; date +%T
