#!/bin/bash
# Call 1 (issue 34): the lm_head with the greedy choice fused (greedy::head_greedy: the Q4/Q8
# GEMV storing the capped logits and each cube's best, one pick kernel) against the build before
# (prev/bench.gz, commit 651ed46: GEMV, softcap where capped, chunk_stats + sample).
# 1) its kernel test and the GEMV, sampling and softcap tests on CUDA (f32, bf16; seed 20261130);
# 2) CUDA-graph decode against eager decode (tests/integration/cuda_graph.rs);
set -u
cd "$(dirname "$0")"
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
gzip -dc kernel_tests.gz > /tmp/kernel_tests; chmod +x /tmp/kernel_tests
BURN_GEMMA_TEST_SEED=20261130 timeout 150 /tmp/kernel_tests --test-threads 2 greedy:: quant::check::gpu sampling::gpu softcap::gpu > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result|panicked" $OUT/kernel-tests.txt | head -30; date +%T
gzip -dc integration.gz > /tmp/integration; chmod +x /tmp/integration
names=$(/tmp/integration --list 2>/dev/null | sed -n 's/^\(cuda_graph::.*\): test$/\1/p')
BURN_GEMMA_FIXTURES=$PWD/../tests/fixtures timeout 360 /tmp/integration --test-threads 1 --nocapture --exact $names > $OUT/cuda_graph.txt 2>&1; echo "rc $?" >> $OUT/cuda_graph.txt
grep -E "^test |rc |test result|steps equal|panicked" $OUT/cuda_graph.txt | head -40; date +%T
