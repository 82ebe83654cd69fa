#!/bin/bash
# GPU call 4: the k-quant kernel tests on CUDA again after the GELU-pairs check moved to f64 host
# products (f32 and bf16; the fixed seed, then a fresh one), with the Q4/Q8 ones beside them.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname $LT)
gzip -dc kernel_tests.gz > /tmp/kernel_tests; chmod +x /tmp/kernel_tests
BURN_GEMMA_TEST_SEED=20261128 timeout 200 /tmp/kernel_tests --test-threads 2 kquant quant::check > $OUT/tests.txt 2>&1
echo "fixed seed rc $?" >> $OUT/tests.txt
timeout 100 /tmp/kernel_tests --test-threads 2 kquant > $OUT/tests-fresh.txt 2>&1; echo "fresh rc $?" >> $OUT/tests-fresh.txt
grep -E "^test |rc |result|panicked|seed|GELU" $OUT/tests.txt $OUT/tests-fresh.txt | tail -40
