#!/bin/bash
# GPU call 1: the new flash-attention kernel's tests (bf16, f16), the attention tests through
# the dispatcher (flash now the default for prompts of 16+ positions), the blocked path, and
# the cuBLASLt ordering tests of c04420e's review mend.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
gzip -dc kernel_tests.gz > /tmp/kernel_tests; chmod +x /tmp/kernel_tests
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export BURN_GEMMA_TEST_SEED=20261128
timeout 200 /tmp/kernel_tests --test-threads 1 attention::flash > $OUT/flash.txt 2>&1; echo "flash rc $?" >> $OUT/flash.txt
tail -c 6000 $OUT/flash.txt
timeout 200 /tmp/kernel_tests --test-threads 1 attention:: cublas > $OUT/tests.txt 2>&1; echo "tests rc $?" >> $OUT/tests.txt
grep -E "^test |rc |result|panicked|worst" $OUT/tests.txt | tail -60
