#!/bin/bash
# GPU call 3: after the router's decode-step scores moved to an f32 matrix (no Burn cast, which
# recordings do not see): every CUDA-graph test, the engine's and the tiny models' CUDA tests,
# the vision fixtures on CUDA.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
gzip -dc integration.gz > /tmp/integration; chmod +x /tmp/integration
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261130 BURN_GEMMA_FIXTURES=$PWD/../tests/fixtures
timeout 500 /tmp/integration --test-threads 1 --nocapture cuda > $OUT/tests.txt 2>&1
echo "rc $?" >> $OUT/tests.txt
grep -E "^test |rc |test result|panicked|first decode|steps equal" $OUT/tests.txt | head -60
