#!/bin/bash
# GPU call 4: this build's tests on CUDA: CUDA-graph decode (now with programmatic dependent
# launch) against eager decode, the drafts test on a random 1B, and the GEMM tests (cuBLASLt
# after its layout logic moved; call 1 ran out of time before them).
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
gzip -dc integration.gz > /tmp/integration; gzip -dc kernel_tests.gz > /tmp/kernel_tests; chmod +x /tmp/integration /tmp/kernel_tests
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261129 BURN_GEMMA_FIXTURES=$PWD/../tests/fixtures
timeout 150 /tmp/integration --test-threads 1 --nocapture cuda_graph:: generation::cuda_graph speculative::random_1b > $OUT/tests.txt 2>&1
echo "integration rc $?" >> $OUT/tests.txt
timeout 100 /tmp/kernel_tests --test-threads 1 gemm:: graph:: > $OUT/kernel-tests.txt 2>&1; echo "kernel tests rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result|panicked|steps equal" $OUT/tests.txt $OUT/kernel-tests.txt
