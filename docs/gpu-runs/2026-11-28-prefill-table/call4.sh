#!/bin/bash
# GPU call 4 (not run this session: the device time ran out; for the next one). Needs
# .gpu-bench/ with bench.gz, kernel_tests.gz and integration.gz of the same build.
# 1. The cuBLASLt tests after the BLASLt layout logic moved to gemm::blas_layout (shared with
#    hipBLASLt), the tuner's tests, and drafts on a random 1B keeping greedy output.
# 2. The 128K context of Gemma 3 4B (random bf16 weights, the whole model) after the tuning key
#    classed the blocked attention's key lengths (call 3's 131,071-token prompt spent its 120 s
#    timing a new GEMM class for each chunk): one timed pass after a warm-up pass, chunks of
#    2,048 tokens, peak device memory.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
for f in bench kernel_tests integration; do gzip -dc $f.gz > /tmp/$f; chmod +x /tmp/$f; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export BURN_GEMMA_TEST_SEED=20261129
timeout 150 /tmp/kernel_tests --test-threads 1 gemm:: > $OUT/tests.txt 2>&1; echo "kernel tests rc $?" >> $OUT/tests.txt
timeout 150 /tmp/integration --test-threads 1 --nocapture speculative::random_1b >> $OUT/tests.txt 2>&1
echo "integration rc $?" >> $OUT/tests.txt
grep -E "^test |rc |result|panicked|random 1B" $OUT/tests.txt
BURN_GEMMA_CACHE=/tmp/cache128k timeout 200 /tmp/bench --model synthetic:gemma3-4b --backend cuda --dtype bf16 \
  --prompt-len 131071 --gen 1 --reps 1 > $OUT/long128k.txt 2>&1; echo "rc $?" >> $OUT/long128k.txt
cut -c1-400 $OUT/long128k.txt
